"""The rejection sampler keeps the target distribution exactly (chi-square against it), with
drafters close to and far from the target, with and without draft probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from memwall.sample.seeds import position_generator
from memwall.spec_decode.rejection import verify_greedy, verify_random, verify_seeded

V, K, TRIALS = 8, 3, 6000


def distributions(seed: int, far: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K + 1, V] (independent per position) and a drafter q [K, V] near or far."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=gen) * 1.5, dim=-1)
    if far:
        q = torch.softmax(torch.randn(K, V, generator=gen) * 2.0, dim=-1)
    else:
        q = torch.softmax(torch.log(p[:K]) + 0.3 * torch.randn(K, V, generator=gen), dim=-1)
    return p, q


def emitted(p: torch.Tensor, q: torch.Tensor | None, fixed_drafts: list[int] | None,
            seed: int) -> np.ndarray:
    """[TRIALS, 2]: the first two tokens each trial emits (-1: it emitted one only)."""
    gen = torch.Generator().manual_seed(seed)
    out = np.full((TRIALS, 2), -1)
    for t in range(TRIALS):
        if fixed_drafts is None:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(K)]
        else:
            drafts = fixed_drafts
        accepted, token = verify_random(p, drafts, q if fixed_drafts is None else None, gen)
        tokens = drafts[:accepted] + [token]
        out[t, :min(2, len(tokens))] = tokens[:2]
    return out


def assert_distributed_as(samples: np.ndarray, probs: torch.Tensor) -> None:
    observed = np.bincount(samples, minlength=V)
    expected = probs.double().numpy()
    expected = expected / expected.sum() * len(samples)
    keep = expected >= 5  # chi-square needs enough expected counts; the rest is one bin
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3, (observed, expected.round(1))


@pytest.mark.parametrize("far", [False, True], ids=["close-drafter", "far-drafter"])
def test_draft_model_rejection_keeps_the_target_distribution(far):
    p, q = distributions(seed=1 + far, far=far)
    out = emitted(p, q, None, seed=10 + far)
    assert_distributed_as(out[:, 0], p[0])
    # the second token is position 1's whenever the first draft was accepted (else the trial
    # stopped): conditioned on that, it must follow p[1] too
    second = out[:, 1][out[:, 1] >= 0]
    assert len(second) > 500
    assert_distributed_as(second, p[1])


@pytest.mark.parametrize("draft", [0, 5], ids=["likely-draft", "unlikely-draft"])
def test_ngram_drafts_without_probabilities_keep_the_target_distribution(draft):
    p, _ = distributions(seed=3, far=False)
    drafts = [int(p[0].argmax()) if draft == 0 else int(p[0].argmin())] + [1, 2]
    out = emitted(p, None, drafts, seed=20 + draft)
    assert_distributed_as(out[:, 0], p[0])


def test_acceptance_rate_is_the_overlap_of_the_distributions():
    p, q = distributions(seed=4, far=True)
    out = emitted(p, q, None, seed=30)
    overlap = float(torch.minimum(p[0], q[0]).sum())
    gen = torch.Generator().manual_seed(30)
    accepted_first = 0
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(K)]
        accepted, _ = verify_random(p, drafts, q, gen)
        accepted_first += accepted > 0
    assert abs(accepted_first / TRIALS - overlap) < 0.03
    assert out.shape == (TRIALS, 2)


def test_identical_distributions_accept_everything():
    p, _ = distributions(seed=5, far=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = [int(torch.multinomial(p[j], 1, generator=gen)) for j in range(K)]
        accepted, _ = verify_random(p, drafts, p[:K], gen)
        assert accepted == K


def test_seeded_verification_is_reproducible():
    p, q = distributions(seed=6, far=True)
    runs = [[verify_random(p, [1, 2, 3], q, torch.Generator().manual_seed(7)) for _ in range(3)]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_greedy_accepts_the_argmax_prefix():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 9]) == (2, 6)
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == (3, 7)
    assert verify_greedy([4, 5], [3]) == (0, 4)
    assert verify_greedy([4], []) == (0, 4)


def test_a_seeded_verify_emits_the_plain_samplers_draws_and_keeps_a_draft_as_often_as_p():
    """verify_seeded: the tokens are what sampling each position alone with its generator
    gives, however many drafts there are, and a fixed draft is kept with probability p(d)."""
    p, _ = distributions(4, far=False)
    kept = 0
    for seed in range(TRIALS):
        plain = []
        for j in range(K + 1):  # the plain sampler's token at each position
            gen = position_generator(seed, 10 + j)
            q = torch.empty(V).exponential_(generator=gen)
            plain.append(int(torch.argmax(p[j] / q)))
        for drafts in ([], plain[:1], plain[:K], [plain[0], (plain[1] + 1) % V, 0]):
            gens = [position_generator(seed, 10 + j) for j in range(len(drafts) + 1)]
            accepted, token = verify_seeded(p[:len(drafts) + 1], drafts, gens)
            assert drafts[:accepted] + [token] == plain[:accepted + 1]
            assert accepted == len(drafts) or drafts[accepted] != plain[accepted]
        gens = [position_generator(seed, 10), position_generator(seed, 11)]
        kept += verify_seeded(p[:2], [2], gens)[0]
    expected = float(p[0, 2]) * TRIALS
    assert abs(kept - expected) < 4 * (expected * (1 - float(p[0, 2]))) ** 0.5, (kept, expected)


def test_position_seeds_differ_by_seed_and_position_and_take_any_int64():
    from memwall.sample.seeds import position_seed

    seeds = {position_seed(s, i) for s in (-(2 ** 63), -1, 0, 1, 2, 2 ** 63 - 1) for i in range(50)}
    assert len(seeds) == 300 and all(0 <= s < 2 ** 64 for s in seeds)
    assert position_generator(None, 3) is None
    a = torch.rand(4, generator=position_generator(7, 3))
    assert torch.equal(a, torch.rand(4, generator=position_generator(7, 3)))
