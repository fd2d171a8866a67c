"""A Gemma 3 GGUF as llama.cpp's converter writes it (norms stored as 1 + w, Gemma tensor names,
no q/k permutation, the layer pattern and local rope base implied by the architecture) loads to
the same logits as the transformers model it was converted from."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from memwall.config import ModelArchConfig
from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf
from memwall.models.registry import build_model
from tests.models.test_forward_parity import hf_logits, run_chunks

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def build_hf_gemma3(directory):
    import transformers

    torch.manual_seed(7)
    config = transformers.Gemma3TextConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=8, query_pre_attn_scalar=16, rms_norm_eps=1e-6, initializer_range=0.25,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


def write_gemma3_gguf(path, model) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1.0  # the converter's norm shift
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma3_gguf_matches_its_transformers_model(tmp_path):
    model = build_hf_gemma3(tmp_path / "hf")
    write_gemma3_gguf(tmp_path / "g.gguf", model)
    reader = open_gguf(tmp_path / "g.gguf")
    config = gguf_hf_config(reader)
    arch = ModelArchConfig.from_hf_dict(config)
    assert arch.layer_types == tuple(model.config.layer_types)
    assert arch.rope_local_theta == 10_000.0 and arch.norm_weight_offset == 0.0
    ours = build_model(arch)
    ours.load_weights(iter_gguf_tensors(reader, config))
    ids = [(i * 37 + 11) % 300 + 4 for i in range(40)]
    reference = hf_logits(tmp_path / "hf", ids)
    for chunks in ([40], [13, 7, 20], [25] + [1] * 15):
        torch.testing.assert_close(run_chunks(ours.eval(), arch, ids, chunks), reference,
                                   atol=1e-4, rtol=1e-4)
    assert np.isfinite(reference.numpy()).all()
