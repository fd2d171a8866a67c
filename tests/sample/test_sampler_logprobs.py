"""Logprobs describe the raw logits: unaffected by temperature, penalties, top-k or bans."""

from __future__ import annotations

import torch

from memwall.sample import Sampler, compute_logprobs
from memwall.sampling_params import SamplingParams

from sample_helpers import build_meta


def _reference_rank(logprobs: torch.Tensor, token: int) -> int:
    return int((logprobs > logprobs[token]).sum()) + 1


def test_sample_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3  # [6, 40]
    reference = torch.log_softmax(logits, dim=-1)  # [6, 40]
    params = [SamplingParams(temperature=0.3, logprobs=4, repetition_penalty=1.8, presence_penalty=1.0),
              SamplingParams(temperature=2.0, top_k=3, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=2.0),
              SamplingParams(top_p=0.5), SamplingParams(min_p=0.3, logprobs=1),
              SamplingParams(temperature=1.0, logprobs=3)]
    meta = build_meta(params, prompt=[[1, 2, 3]] * 6, output=[[4, 4, 5]] * 6, banned=[[7]] * 6)
    out = Sampler()(logits.clone(), meta)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (6, 5) and lp.logprobs.dtype == torch.float32
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    chosen = reference.gather(1, sampled[:, None])[:, 0]  # [6]
    torch.testing.assert_close(lp.logprobs[:, 0], chosen, atol=1e-6, rtol=0)
    top_values, top_ids = reference.topk(4, dim=-1)  # [6, 4]
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values, atol=1e-6, rtol=0)
    assert lp.ranks.tolist() == [_reference_rank(reference[i], int(t)) for i, t in enumerate(sampled)]


def test_logprobs_do_not_depend_on_sampling_settings() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 30)  # [1, 30]
    plain = Sampler()(logits, build_meta([SamplingParams(temperature=0.0, logprobs=5)])).logprobs
    hot = Sampler()(logits, build_meta([SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0)],
                                       prompt=[list(range(30))], banned=[[int(logits.argmax())]])).logprobs
    assert plain is not None and hot is not None
    assert torch.equal(plain.token_ids[:, 1:], hot.token_ids[:, 1:])
    assert torch.equal(plain.logprobs[:, 1:], hot.logprobs[:, 1:])
    assert plain.ranks.tolist() == [1] and hot.ranks.tolist() == [2]  # the ban forced the runner-up


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(torch.randn(2, 10), build_meta([SamplingParams(), SamplingParams(temperature=0.0)]))
    assert out.logprobs is None


def test_compute_logprobs_for_given_tokens() -> None:
    """Prompt logprobs: column 0 is the given token, whatever its rank; k=0 gives one column."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 3.0, 0.0, 1.0]])  # [2, 4]
    reference = torch.log_softmax(logits, dim=-1)
    lp = compute_logprobs(logits, torch.tensor([0, 1]), k=0)
    assert lp.token_ids.tolist() == [[0], [1]]
    torch.testing.assert_close(lp.logprobs[:, 0], reference[[0, 1], [0, 1]], atol=1e-6, rtol=0)
    assert lp.ranks.tolist() == [4, 1]  # a tie shares the better rank
    lp = compute_logprobs(logits, torch.tensor([2, 3]), k=2)
    assert lp.token_ids[0].tolist() == [2, 3, 2] and lp.ranks.tolist() == [2, 3]


def test_compute_logprobs_clamps_k_to_vocab_and_keeps_float32() -> None:
    logits = torch.randn(3, 5, dtype=torch.float16)  # [3, 5]
    lp = compute_logprobs(logits, torch.tensor([0, 1, 2]), k=20)
    assert lp.token_ids.shape == (3, 6) and lp.logprobs.dtype == torch.float32
