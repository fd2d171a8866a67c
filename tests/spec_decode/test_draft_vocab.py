"""A drafter's reduced vocabulary (speculative_config "draft_vocab_size"): the cut head's logits
are the full head's first columns (float and packed GGUF heads), drafts never leave the
subset, greedy output still equals plain decoding for both drafter kinds, the start-up cost
measurement times the head drafts are read from, and bad sizes are refused in one line."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.config import SpeculativeConfig
from memwall.loader.model_loader import load_model
from memwall.spec_decode.draft_vocab import DraftVocabError, DraftVocabHead, draft_head
from memwall.spec_decode.proposer import DraftRequest

CUT = 96  # of the tiny models' vocabulary: drafts below it only


def prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of low ids, so that the model's greedy tokens often fall below CUT."""
    rng = random.Random(seed)
    return [[rng.randrange(4, CUT) for _ in range(rng.randrange(1, 50))] for _ in range(count)]


def test_the_cut_head_gives_the_full_heads_first_logits(target):
    model = load_model(str(target)).model
    hidden = torch.randn(5, model.config.hidden_size)
    head = DraftVocabHead(model.lm_head, CUT)
    torch.testing.assert_close(head(hidden), model.compute_logits(hidden)[:, :CUT])
    assert head.out_features == CUT
    assert draft_head(model, None) == model.compute_logits  # no cut: the model's own head
    assert draft_head(model, 10 ** 9) == model.compute_logits  # past the vocabulary: no cut


def test_a_packed_quantized_head_cuts_to_the_same_logits(gguf_path):
    """The embedded GGUF's tied Q8_0 head (packed into panels on VNNI builds): the cut copy,
    packed again, gives the same logits for its ids, one row or sixteen."""
    from memwall.quant.packing import pack_model

    model = load_model(str(gguf_path)).model
    pack_model(model)
    head = DraftVocabHead(model.lm_head, 4096)
    for rows in (1, 16):
        hidden = torch.randn(rows, model.config.hidden_size)
        torch.testing.assert_close(head(hidden), model.compute_logits(hidden)[:, :4096],
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("size", [4096, None])
def test_a_4_bit_copy_of_the_head_is_within_int4_rounding_of_it(gguf_path, size):
    """``four_bit`` (an EAGLE head's ``"requantize": "q4_1"``): the copied rows of the packed
    Q8_0 head become int4 codes, a scale and an offset per 32 values; their logits differ
    from the head's by int4's rounding, not more, and the whole vocabulary may be copied."""
    from memwall.quant.packing import pack_model

    model = load_model(str(gguf_path)).model
    pack_model(model)
    vocab = model.lm_head.out_features
    head = draft_head(model, size, four_bit=True)
    rows = size or vocab
    assert isinstance(head, DraftVocabHead) and head.out_features == rows
    assert head.rows.source == "int4 g32" and model.lm_head.source == "gguf Q8_0"
    hidden = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = model.compute_logits(hidden)[:, :rows]
    cut = head(hidden)
    err = (cut - full).norm() / full.norm()
    assert 0 < err < 0.15, err  # rounded (not a copy of the Q8_0 rows), by 4-bit steps only
    agree = (cut.argmax(-1) == full.argmax(-1)).float().mean()
    assert agree >= 0.75, agree


def _proposer(llm):
    return llm.engine.core.executor.worker.runner.proposer


def test_draft_model_drafts_below_the_cut_and_keeps_greedy_output(target, noisy_draft):
    ps = prompts(12, seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(target), num_kv_blocks=256, block_size=4).generate(ps, params)
    spec = {"method": "draft_model", "model": str(noisy_draft), "num_speculative_tokens": 4,
            "adaptive": False, "draft_vocab_size": CUT, "lookup_first": False}  # the drafter's own
    llm = LLM(str(target), speculative_config=spec, num_kv_blocks=60, block_size=4,
              max_num_batched_tokens=24, max_num_seqs=6)
    out = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.core.scheduler.stats
    assert stats.spec_num_verify_steps > 20 and stats.spec_num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    proposer = _proposer(llm)
    drafts = proposer.propose([DraftRequest(f"r{i}", np.array(p, dtype=np.int64), 4)
                               for i, p in enumerate(prompts(8, seed=5))])
    assert drafts and all(0 <= t < CUT for d in drafts.values() for t in d)
    # the start-up measurement times the cut head, not the model's whole one
    assert proposer.drafting_model.compute_logits is proposer.logits
    assert isinstance(proposer.logits, DraftVocabHead)


def test_eagle_drafts_below_the_cut_and_keeps_greedy_output(target, tmp_path):
    import json

    from safetensors.torch import save_file

    from memwall.config import ModelArchConfig
    from memwall.spec_decode.eagle import EagleHead

    config = json.loads((target / "config.json").read_text())
    torch.manual_seed(3)
    head = EagleHead(ModelArchConfig.from_hf_dict({**config, "num_hidden_layers": 1}), fc_bias=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    save_file({k: v.detach().clone() for k, v in head.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    ps = prompts(8, seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(str(target), num_kv_blocks=256, block_size=4).generate(ps, params)
    spec = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 3,
            "adaptive": False, "draft_vocab_size": CUT, "lookup_first": False}  # the head's own
    llm = LLM(str(target), speculative_config=spec, num_kv_blocks=256, block_size=4)
    out = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    proposer = _proposer(llm)
    assert isinstance(proposer.logits, DraftVocabHead)
    assert proposer.drafting_model.lm_head is proposer.logits  # timed at start-up
    assert llm.engine.core.scheduler.stats.spec_num_draft_tokens > 0


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram", "draft_vocab_size": 100}, "draft_model and eagle"),
    ({"method": "draft_model", "model": "x", "draft_vocab_size": 0}, "positive integer"),
    ({"method": "draft_model", "model": "x", "draft_vocab_size": "1k"}, "positive integer"),
    ({"method": "draft_model", "model": "x", "draft_vocab_size": True}, "positive integer"),
])
def test_bad_sizes_are_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_a_cut_of_the_whole_vocabulary_is_no_cut(target):
    model = load_model(str(target)).model
    vocab = model.lm_head.out_features
    assert draft_head(model, vocab) == model.compute_logits
    with pytest.raises(DraftVocabError, match="draft_vocab_size must be in"):
        DraftVocabHead(model.lm_head, vocab)
