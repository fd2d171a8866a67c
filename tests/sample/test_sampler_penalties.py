"""Penalties against hand-computed numbers."""

from __future__ import annotations

import torch

from memwall.sample import Sampler
from memwall.sample.penalties import apply_penalties
from memwall.sampling_params import SamplingParams

from sample_helpers import build_meta

LOGITS = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


def penalised(params: SamplingParams, prompt: list[int] = PROMPT, output: list[int] = OUTPUT) -> list[float]:
    logits = torch.tensor([LOGITS])  # [1, 6]
    apply_penalties(logits, build_meta([params], prompt=[prompt], output=[output]))
    return logits[0].tolist()


def test_repetition_divides_positive_and_multiplies_negative() -> None:
    # prompt: 0 (2.0 -> 1.0), 1 (-1.0 -> -2.0); output: 2 (0.5 -> 0.25), 3 (-0.5 -> -1.0)
    assert penalised(SamplingParams(repetition_penalty=2.0)) == [1.0, -2.0, 0.25, -1.0, 1.0, 0.0]


def test_repetition_below_one_rewards_seen_tokens() -> None:
    assert penalised(SamplingParams(repetition_penalty=0.5)) == [4.0, -0.5, 1.0, -0.25, 1.0, 0.0]


def test_frequency_counts_output_occurrences_only() -> None:
    # token 2 was generated twice, token 3 once; prompt tokens 0/1 are not touched.
    assert penalised(SamplingParams(frequency_penalty=0.5)) == [2.0, -1.0, -0.5, -1.0, 1.0, 0.0]


def test_presence_subtracts_once_per_generated_token() -> None:
    assert penalised(SamplingParams(presence_penalty=0.25)) == [2.0, -1.0, 0.25, -0.75, 1.0, 0.0]


def test_all_three_combined() -> None:
    # rep 2, freq 0.5, pres 0.25: token 2: 0.5/2 - 0.5*2 - 0.25 = -1.0; token 3: -0.5*2 - 0.5 - 0.25 = -1.75
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert penalised(params) == [1.0, -2.0, -1.0, -1.75, 1.0, 0.0]


def test_negative_penalties_encourage() -> None:
    params = SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5)
    assert penalised(params) == [2.0, -1.0, 3.0, 1.0, 1.0, 0.0]


def test_penalties_are_per_row() -> None:
    """Same token history in every row; only the row that asks for a penalty is changed."""
    logits = torch.tensor([LOGITS] * 3)  # [3, 6]
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.0)]
    apply_penalties(logits, build_meta(params, prompt=[PROMPT] * 3, output=[OUTPUT] * 3))
    assert logits.tolist() == [LOGITS, [1.0, -2.0, 0.25, -1.0, 1.0, 0.0], [2.0, -1.0, -1.5, -1.5, 1.0, 0.0]]


def test_sampler_applies_penalties_before_greedy() -> None:
    """Token 0 wins raw, but a repetition penalty of 3 (2.0 -> 0.67) hands the win to token 4."""
    logits = torch.tensor([LOGITS] * 2)  # [2, 6]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=3.0)]
    meta = build_meta(params, prompt=[PROMPT] * 2, output=[OUTPUT] * 2)
    assert not meta.no_penalties
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, 4]
