"""Fixtures shared by the draft-model tests: a tiny target and a noisy copy of it as drafter."""

from __future__ import annotations

import shutil

import pytest
import torch


@pytest.fixture(scope="package")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="package")
def noisy_draft(target, tmp_path_factory):
    """The target with noise on every weight: agrees with it often, not always."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    out = tmp_path_factory.mktemp("draft")
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, out / name)
    return out
