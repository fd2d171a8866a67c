"""benchmarks/synthetic_gguf.py writes a GGUF that memwall loads with the requested shape, the
embedded tokenizer and chat template, and finite weights in the stated range."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks import synthetic_gguf  # noqa: E402
from memwall import LLM, SamplingParams  # noqa: E402
from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf  # noqa: E402


def test_synthetic_gguf_loads_with_its_shape_and_the_embedded_tokenizer(tmp_path, gguf_path):
    path = synthetic_gguf.write(tmp_path / "tiny.gguf", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256)
    reader = open_gguf(path)
    cfg = gguf_hf_config(reader)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (128, 2, 4, 2, 256)
    assert cfg["vocab_size"] == 49152
    tensors = dict(iter_gguf_tensors(reader, cfg, torch.float32))
    up = tensors["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (256, 128)
    assert torch.isfinite(up).all() and up.abs().max() <= 0.17

    llm = LLM(str(path), num_kv_blocks=16, max_model_len=128)
    embedded = LLM(str(gguf_path), num_kv_blocks=16, max_model_len=128)
    assert llm.tokenizer.encode("Hello, world") == embedded.tokenizer.encode("Hello, world")
    messages = [{"role": "user", "content": "hi"}]
    assert llm.render_chat(messages) == embedded.render_chat(messages)  # the chat template came along
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
