"""Seeded sampling: each output position of a seeded request draws from a generator of its own.

A request with ``seed`` gets, for its output token number ``index`` (0 for its first), a
generator seeded from (seed, index) and nothing else. One generator a request, drawn in turn,
made its tokens depend on how many numbers earlier steps drew: speculative verification draws
one uniform per examined draft before its token, and how many drafts a step examines depends on
the adaptive draft lengths, which follow the step times this machine measures. The same seeded
request then gave different tokens from one run to the next with speculation on (n-gram, EAGLE
and draft model alike, the embedded model at temperature 0.8). Keyed by position, the token at
``index`` is the same draw whether it is sampled alone, verified behind 0 or 4 drafts, or after
a preemption recomputed the sequence (spec_decode/rejection.py ``verify_seeded``).
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def position_seed(seed: int, index: int) -> int:
    """A 64-bit seed for output position ``index`` of a request seeded with ``seed`` (any
    int64, negative too): splitmix64 of the pair, so neighbouring seeds and positions give
    unrelated streams (``seed + index`` for the n-th completion of a request is its own
    request's seed: SamplingParams.for_index)."""
    z = ((seed & _MASK) * 0x9E3779B97F4A7C15 + (index & _MASK) + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def position_generator(seed: int | None, index: int, device: torch.device | str = "cpu"
                       ) -> torch.Generator | None:
    """The generator of output position ``index`` of a request seeded with ``seed`` (None: an
    unseeded request, which draws from the shared default generator)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(position_seed(seed, index))
