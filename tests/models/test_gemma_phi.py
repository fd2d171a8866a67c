"""Gemma 2, Gemma 3 and Phi-3 through the whole engine: greedy tokens equal transformers'
generate, with decodes that cross the sliding window (8 tokens in the tiny configs) and
chunked prefills that start past it, alone and batched."""

from __future__ import annotations

import random

import pytest
import torch

from memwall import LLM, SamplingParams

KINDS = ["gemma2", "gemma3", "phi3"]


def hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf_generate_across_the_window(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    prompts = [[5, 17, 99, 230, 42], [(i * 31 + 7) % 300 + 4 for i in range(30)]]
    llm = LLM(str(path), num_kv_blocks=128, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)  # batched; the 30-token prompt is chunked (16 a step)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 20), prompt
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_batch_invariance_under_preemption(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(path), num_kv_blocks=256, block_size=4)
    alone = [roomy.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    tight = LLM(str(path), num_kv_blocks=40, block_size=4, max_num_batched_tokens=24,
                max_num_seqs=8, max_model_len=96)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert together == alone
    assert tight.engine.num_free_blocks == tight.engine.num_total_blocks


def test_window_layers_never_gather_blocks_before_the_window():
    """A sliding layer's prefill chunk past the window reads only the blocks its queries see."""
    from memwall.attention import paged_torch
    from memwall.attention.metadata import AttentionMetadata

    block, heads, dim = 4, 2, 8
    k_cache = torch.randn(16, block, heads, dim)
    v_cache = torch.randn(16, block, heads, dim)
    meta = AttentionMetadata.build([4], [40], [list(range(10))], block)
    q = torch.randn(4, heads, dim)
    full = paged_torch.paged_attention(q, k_cache, v_cache, meta, 0.3, window=8)
    # poison every block before the first visible key (position 36 - 8 + 1 = 29: block 7)
    k_cache[:7] = float("nan")
    v_cache[:7] = float("nan")
    again = paged_torch.paged_attention(q, k_cache, v_cache, meta, 0.3, window=8)
    assert torch.equal(full, again)


def test_unknown_architecture_names_it_and_the_list(tmp_path):
    import json

    from memwall.loader.errors import ModelLoadError
    from memwall.loader.hf_loader import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM.*Gemma3ForCausalLM"):
        read_hf_config(tmp_path)
