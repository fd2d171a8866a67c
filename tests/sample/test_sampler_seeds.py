"""Seeded rows: the same seed gives the same tokens whatever shares the batch."""

from __future__ import annotations

import random

import torch

from memwall.sample import Sampler
from memwall.sampling_params import SamplingParams

from sample_helpers import build_meta

VOCAB = 64
STEPS = 20
TARGET = SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=1234)


def step_logits(step: int, history: list[int]) -> torch.Tensor:
    """A stand-in model: logits depend on the step and the last token, nothing else."""
    last = history[-1] if history else 0
    g = torch.Generator().manual_seed(step * 1000 + last)
    return torch.randn(VOCAB, generator=g)  # [V]


def run_alone(params: SamplingParams) -> list[int]:
    gen = torch.Generator().manual_seed(params.seed)
    history: list[int] = []
    for step in range(STEPS):
        meta = build_meta([params], generators=[gen], output=[history])
        history.append(int(Sampler()(step_logits(step, history)[None], meta).sampled_token_ids[0]))
    return history


def run_in_batch(params: SamplingParams, shuffle_seed: int) -> list[int]:
    """The target row among 6 others (seeded, unseeded, greedy, penalised), at a new position
    every step; the unseeded rows also move the shared default generator."""
    others = [SamplingParams(seed=7), SamplingParams(temperature=0.0), SamplingParams(top_p=0.3),
              SamplingParams(seed=99, min_p=0.1, presence_penalty=1.0), SamplingParams(temperature=2.0),
              SamplingParams(seed=1234)]  # same seed as the target, but its own generator
    rows = [params, *others]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in rows]
    histories: list[list[int]] = [[] for _ in rows]
    shuffler = random.Random(shuffle_seed)
    torch.manual_seed(shuffle_seed)
    for step in range(STEPS):
        order = list(range(len(rows)))
        shuffler.shuffle(order)
        logits = torch.stack([step_logits(step, histories[i]) for i in order])  # [7, V]
        meta = build_meta([rows[i] for i in order], generators=[gens[i] for i in order],
                          output=[histories[i] for i in order])
        tokens = Sampler()(logits, meta).sampled_token_ids.tolist()
        for position, i in enumerate(order):
            histories[i].append(tokens[position])
    return histories[0]


def test_same_seed_same_tokens_alone_or_in_any_batch() -> None:
    alone = run_alone(TARGET)
    assert len(set(alone)) > 5, "the target must really be sampling, not stuck on one token"
    assert run_alone(TARGET) == alone
    for shuffle_seed in (0, 1, 2):
        assert run_in_batch(TARGET, shuffle_seed) == alone


def test_different_seeds_differ() -> None:
    sequences = {tuple(run_alone(SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=s)))
                 for s in (1234, 1235, 1236)}
    assert len(sequences) == 3


def test_seeded_row_ignores_the_default_generator() -> None:
    logits = torch.randn(1, VOCAB)  # [1, V]
    tokens = []
    for default_seed in (0, 1, 2):
        torch.manual_seed(default_seed)
        gen = torch.Generator().manual_seed(5)
        meta = build_meta([SamplingParams(seed=5)], generators=[gen])
        tokens.append([int(Sampler()(logits, meta).sampled_token_ids[0]) for _ in range(10)])
    assert tokens[0] == tokens[1] == tokens[2]
