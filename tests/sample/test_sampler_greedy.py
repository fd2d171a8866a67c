"""Greedy rows, banned tokens and the metadata flags."""

from __future__ import annotations

import pytest
import torch

from memwall.sample import Sampler
from memwall.sampling_params import SamplingParams

from sample_helpers import build_meta


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                           [5.0, 5.0, 5.0, 5.0],
                           [-2.0, -1.0, -7.0, -1.0]])  # [3, 4]
    meta = build_meta([SamplingParams(temperature=0.0)] * 3)
    for _ in range(5):
        assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 0, 1]


def test_tiny_temperature_counts_as_greedy() -> None:
    meta = build_meta([SamplingParams(temperature=1e-6)])
    assert meta.all_greedy and meta.temperature.tolist() == [0.0]
    assert Sampler()(torch.tensor([[0.0, 0.1, 0.0]]), meta).sampled_token_ids.tolist() == [1]


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 50)  # [64, 50]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5 * (i % 3)) for i in range(64)]
    meta = build_meta(params)
    assert not meta.all_greedy and not meta.all_random
    tokens = Sampler()(logits, meta).sampled_token_ids  # [64]
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))
    # The random rows really were sampled, not argmaxed.
    assert not torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


def test_banned_tokens_greedy_picks_best_allowed() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])  # [2, 4]
    meta = build_meta([SamplingParams(temperature=0.0)] * 2, banned=[[0], [0, 1, 3]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 2]


def test_banned_tokens_never_sampled() -> None:
    torch.manual_seed(0)
    n, vocab = 20_000, 6
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0, 5.0]).repeat(n, 1)  # [n, 6], banned ids dominate
    meta = build_meta([SamplingParams(temperature=3.0)] * n, banned=[[0, 5]] * n)
    counts = torch.bincount(Sampler()(logits, meta).sampled_token_ids, minlength=vocab)  # [6]
    assert counts[0] == 0 and counts[5] == 0
    assert (counts[1:5] > 0).all()


def test_banned_tokens_do_not_touch_the_callers_logits() -> None:
    logits = torch.tensor([[4.0, 3.0]])
    Sampler()(logits, build_meta([SamplingParams(temperature=0.0)], banned=[[0]]))
    assert logits.tolist() == [[4.0, 3.0]]


def test_metadata_flags_and_logprob_count() -> None:
    meta = build_meta([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(logprobs=5),
                       SamplingParams(presence_penalty=0.5)])
    assert (meta.all_greedy, meta.all_random, meta.no_penalties) == (False, False, False)
    assert meta.max_num_logprobs == 5
    assert meta.top_k.dtype == torch.int64 and meta.temperature.dtype == torch.float32
    assert build_meta([SamplingParams()]).max_num_logprobs is None
    assert build_meta([SamplingParams(logprobs=0)]).max_num_logprobs == 0
    assert build_meta([SamplingParams(top_k=-1)]).top_k.tolist() == [0]
    with pytest.raises(ValueError, match="differ in length"):
        build_meta([SamplingParams()], generators=[None, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(dtype: torch.dtype) -> None:
    """The numpy fast path (contiguous float32) and the torch fallback give torch's answers:
    the first maximal index, a NaN counting as the maximum, int64 ids."""
    from memwall.sample.sampler import argmax_rows

    torch.manual_seed(1)
    logits = torch.randn(5, 262144).to(dtype)  # Gemma 3's vocabulary
    logits[1, :] = 2.0  # all tied: id 0
    logits[2, 7] = logits[2, 9] = 50.0  # tie between two maxima: the lower id
    logits[3, 11] = float("nan")
    logits[3, 13] = float("nan")
    logits[4, 262143] = float("inf")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == [int(logits[0].float().argmax()), 0, 7, 11, 262143]
    assert torch.equal(got, logits.argmax(dim=-1))
    strided = logits[:, ::2]  # not contiguous: torch's own argmax
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10)).tolist() == []
