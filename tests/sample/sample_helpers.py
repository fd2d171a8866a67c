"""Helpers for the sampler tests (a unique module name, since tests/ has no packages)."""

from __future__ import annotations

import torch

from memwall.sample import SamplingMetadata
from memwall.sampling_params import SamplingParams


def build_meta(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
               prompt: list[list[int]] | None = None, output: list[list[int]] | None = None,
               banned: list[list[int]] | None = None) -> SamplingMetadata:
    """SamplingMetadata.build with empty token lists and no generators unless given."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        generators if generators is not None else [None] * n,
        prompt if prompt is not None else [[] for _ in range(n)],
        output if output is not None else [[] for _ in range(n)],
        banned if banned is not None else [[] for _ in range(n)],
    )
