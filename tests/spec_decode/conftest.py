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


@pytest.fixture
def draft_sources():
    """watch(proposer) -> a list that gets (request id, "lookup" or "drafter", draft tokens)
    for every draft a LookupFirstProposer makes, in order: the drafter's are the sequences
    its own propose was handed in that call."""

    def watch(proposer) -> list[tuple[str, str, int]]:
        seen: list[tuple[str, str, int]] = []
        served: set[str] = set()
        propose, drafter_propose = proposer.propose, proposer.drafter.propose

        def drafter(requests):
            served.update(r.request_id for r in requests)
            return drafter_propose(requests)

        def watched(requests):
            served.clear()
            drafts = propose(requests)
            seen.extend((rid, "drafter" if rid in served else "lookup", len(d))
                        for rid, d in drafts.items() if d)
            return drafts

        proposer.drafter.propose, proposer.propose = drafter, watched
        return seen

    return watch
