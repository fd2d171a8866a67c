"""DPRouter (memwall/engine/dp_router.py): prefix affinity within a load threshold, least-loaded
with round-robin ties otherwise, a bounded index, in-flight accounting. No model: milliseconds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memwall.engine.dp_router import DPRouter

BS = 4  # block size


def prompt(seed: int, blocks: int, tail: int = 0) -> list[int]:
    """``blocks`` full blocks of tokens particular to ``seed``, then ``tail`` more."""
    return [seed * 1000 + i for i in range(blocks * BS + tail)]


def test_no_match_goes_round_robin_over_idle_replicas():
    router = DPRouter(3, BS)
    picks = [router.route([f"r{i}"], prompt(i, 2)) for i in range(3)]
    assert picks == [0, 1, 2]
    for i in range(3):
        router.finish(f"r{i}")
    assert [router.route([f"s{i}"], prompt(10 + i, 2)) for i in range(3)] == [0, 1, 2]


def test_no_match_goes_to_the_least_loaded():
    router = DPRouter(2, BS)
    router.route(["a"], prompt(1, 1))  # -> 0
    router.route(["b"], prompt(2, 1))  # -> 1
    router.route(["c"], prompt(3, 1))  # tie again -> 0
    assert router.route(["d"], prompt(4, 1)) == 1  # 0 has 2, 1 has 1
    router.finish("a"), router.finish("c")
    assert router.route(["e"], prompt(5, 1)) == 0


def test_a_shared_prefix_follows_its_first_request():
    router = DPRouter(2, BS)
    system = prompt(7, 4)
    first = router.route(["a"], system + [1, 2, 3, 4, 5])
    router.route(["x"], prompt(8, 2))  # the other replica gets unrelated work
    assert router.route(["b"], system + [9, 9, 9, 9, 9, 9]) == first
    assert router.route(["c"], system + [7]) == first  # 2 vs 1 in flight: within the threshold
    assert router.stats().affinity_hits == 2
    assert router.stats().matched_tokens == 2 * 4 * BS


def test_the_longest_match_wins():
    router = DPRouter(2, BS)
    base, longer = prompt(3, 2), prompt(3, 2) + prompt(4, 2)
    assert [router.route([f"a{i}"], base + [i]) for i in range(3)] == [0, 0, 0]  # affinity
    assert router.route(["b"], longer) == 1  # 3 vs 0 in flight: over the threshold of 2
    for sample_id in ("a0", "a1", "a2", "b"):
        router.finish(sample_id)
    # replica 0 knows 2 blocks of it, replica 1 all 4; round robin alone would say 0
    assert router.route(["c"], longer + [5]) == 1


def test_a_match_shorter_than_a_block_is_no_match():
    router = DPRouter(2, BS)
    assert router.route(["a"], [1, 2, 3]) == 0  # no full block: nothing remembered
    assert router.index_size(0) == 0
    router.finish("a")
    assert router.route(["b"], [1, 2, 3]) == 1  # round robin, not affinity
    assert router.stats().affinity_hits == 0


def test_load_beyond_the_threshold_overrides_affinity():
    router = DPRouter(2, BS)  # threshold = max(2, 0.25 * mean load)
    conv = prompt(1, 3)
    assert router.route(["c0"], conv) == 0
    router.route(["other"], prompt(2, 1))  # -> 1
    router.route(["c1"], conv + [5])
    router.route(["c2"], conv + [6])
    assert router.load(0) == 3 and router.load(1) == 1
    assert router.route(["c3"], conv + [7]) == 0  # difference 2 = the threshold: allowed
    assert router.load(0) == 4
    # now 4 vs 1: difference 3 > max(2, 0.25 * 2.5) -> the least-loaded replica instead
    assert router.route(["c4"], conv + [8]) == 1
    stats = router.stats()
    assert stats.load_overrides == 1 and stats.affinity_hits == 3


def test_the_threshold_grows_with_the_mean_load():
    router = DPRouter(2, BS, balance_abs=2, balance_rel=0.25)
    assert router.threshold() == 2
    for i in range(40):  # 20 in flight on each
        router.route([f"r{i}"], prompt(100 + i, 1))
    assert router.threshold() == 0.25 * 20
    conv = prompt(1, 2)
    assert router.route(["c"], conv) == 0  # tie -> round robin: 0 (21 vs 20)
    for i in range(4):  # 25 vs 20 after these: each within 0.25 * mean (> 5)
        assert router.route([f"c{i}"], conv + [i]) == 0
    assert router.load(0) == 25 and router.route(["c9"], conv + [9]) == 0  # 5 <= 0.25 * 22.5
    assert router.route(["c10"], conv + [10]) == 1  # 6 > 0.25 * 23


def test_affinity_ties_go_to_the_less_loaded_then_round_robin():
    router = DPRouter(2, BS)
    system = prompt(4, 2)
    assert [router.route([f"a{i}"], system + [i]) for i in range(3)] == [0, 0, 0]
    assert router.route(["b"], system + [4]) == 1  # overridden: now both replicas know it
    assert router.route(["c"], system + [5]) == 1  # equal matches: 3 vs 1 in flight
    for sample_id in ("a0", "a1", "a2", "b", "c"):
        router.finish(sample_id)
    picks = []
    for i in range(4):  # equal matches and loads: round robin
        picks.append(router.route([f"d{i}"], system + [10 + i]))
        router.finish(f"d{i}")
    assert picks == [0, 1, 0, 1]


def test_in_flight_counts_follow_finish_and_abort():
    router = DPRouter(2, BS)
    replica = router.route(["p", "p/1", "p/2"], prompt(1, 2))  # a request with n=3 samples
    assert router.load(replica) == 3 and router.stats().routed[replica] == 1
    assert router.finish("p/1") == replica and router.load(replica) == 2
    assert router.finish("p/1") is None and router.load(replica) == 2  # twice: harmless
    assert router.replica_of("p") == replica and router.replica_of("p/1") is None
    router.finish("p"), router.finish("p/2")
    assert router.stats().in_flight == (0, 0)
    assert router.finish("never-sent") is None


def test_the_index_is_bounded_and_forgets_tails_first():
    router = DPRouter(1, BS, max_blocks=8)
    old = prompt(1, 6)
    router.route(["old"], old)
    router.route(["new"], prompt(2, 4))  # 6 + 4 > 8: the old prompt loses 2 blocks
    assert router.index_size(0) == 8
    # the old prompt's first 4 blocks survive (its deepest two went first)
    assert router._matched(0, _hashes(old)) == 4
    for i in range(50):
        router.route([f"r{i}"], prompt(10 + i, 3))
    assert router.index_size(0) == 8


def test_namespaces_do_not_match_each_other():
    router = DPRouter(2, BS)
    tokens = prompt(1, 3)
    lora_a = (("lora", "a"),)
    assert router.route(["a"], tokens, lora_a) == 0
    assert router.route(["b"], tokens, (("lora", "b"),)) == 1  # same tokens, other adapter
    assert router.route(["base"], tokens) == 0  # the base model: no match either (round robin)
    router.finish("base")
    assert router.route(["a2"], tokens + [1], lora_a) == 0  # affinity within the namespace
    assert router.stats().affinity_hits == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6), st.booleans()), max_size=60),
       st.integers(1, 4))
def test_loads_always_equal_the_samples_in_flight(events, replicas):
    """Whatever is routed and finished, per-replica loads are what is in flight there, and the
    chosen replica is never busier than the least loaded by more than the threshold."""
    router = DPRouter(replicas, BS, max_blocks=16)
    live: dict[str, int] = {}
    for n, (seed, blocks, done) in enumerate(events):
        if done and live:
            victim = sorted(live)[seed % len(live)]
            router.finish(victim)
            del live[victim]
            continue
        before = [router.load(r) for r in range(replicas)]
        threshold = router.threshold()
        chosen = router.route([str(n)], prompt(seed, blocks, tail=1))
        assert before[chosen] - min(before) <= threshold
        live[str(n)] = chosen
    for r in range(replicas):
        assert router.load(r) == sum(1 for v in live.values() if v == r)
        assert router.index_size(r) <= 16


def _hashes(tokens):
    from memwall.core.kv.hashing import extend_block_hashes
    hashes = []
    extend_block_hashes(hashes, tokens, BS)
    return hashes
