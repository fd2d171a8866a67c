"""GGUF reading: config mapping, tensor names/shapes, q/k un-permutation, damaged files,
and parity with transformers on the embedded SmolLM2 file.

Tiny files are written with gguf.GGUFWriter: a 2-layer model, hidden 64, 4 heads, 2 kv heads,
vocab 128, tensors in a mix of types.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from memwall.loader.gguf_loader import (SUPPORTED_GGUF_ARCHS, SUPPORTED_GGUF_TYPES, ModelLoadError,
                                        _llama3_factors, gguf_hf_config, iter_gguf_tensors,
                                        llama3_scaling_from_factors, open_gguf)

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS

# GGUF layer tensor -> (HF suffix, numpy shape [out, in], type written)
LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", (HIDDEN,), Q.F32),
    "attn_q.weight": ("self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), Q.F32),
    "attn_k.weight": ("self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.F16),
    "attn_v.weight": ("self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
    "attn_output.weight": ("self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_1),
    "ffn_norm.weight": ("post_attention_layernorm.weight", (HIDDEN,), Q.F32),
    "ffn_gate.weight": ("mlp.gate_proj.weight", (FFN, HIDDEN), Q.Q8_0),
    "ffn_up.weight": ("mlp.up_proj.weight", (FFN, HIDDEN), Q.BF16),
    "ffn_down.weight": ("mlp.down_proj.weight", (HIDDEN, FFN), Q.Q8_0),
}


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader must get back from ``w`` written as ``qtype`` (the reference decode)."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def hf_weights(seed: int = 0, *, arch: str = "llama", lm_head: bool = False) -> dict[str, tuple]:
    """HF-named float weights plus the type each is stored as: {hf_name: (array, qtype, gguf_name)}."""
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": (rng.standard_normal((VOCAB, HIDDEN)), Q.Q8_0, "token_embd.weight"),
           "model.norm.weight": (rng.standard_normal(HIDDEN), Q.F32, "output_norm.weight")}
    if lm_head:
        out["lm_head.weight"] = (rng.standard_normal((VOCAB, HIDDEN)), Q.F16, "output.weight")
    for i in range(LAYERS):
        for gname, (suffix, shape, qtype) in LAYER_TENSORS.items():
            out[f"model.layers.{i}.{suffix}"] = (rng.standard_normal(shape), qtype, f"blk.{i}.{gname}")
        if arch == "qwen2":
            for p, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                out[f"model.layers.{i}.self_attn.{p}_proj.bias"] = (
                    rng.standard_normal(n * HEAD_DIM), Q.F32, f"blk.{i}.attn_{p}.bias")
        if arch == "qwen3":
            for p in ("q", "k"):
                out[f"model.layers.{i}.self_attn.{p}_norm.weight"] = (
                    rng.standard_normal(HEAD_DIM), Q.F32, f"blk.{i}.attn_{p}_norm.weight")
    return {k: (v.astype(np.float32) * 0.1, q, g) for k, (v, q, g) in out.items()}


def write_gguf(path: Path, weights: dict[str, tuple], *, arch: str = "llama", name: str = "tiny",
               vocab_key: bool = True, rope_theta: float = 10000.0, extra: dict | None = None, extra_tensors: dict | None = None) -> Path:
    """Write ``weights`` as llama.cpp would: GGUF names, q/k permuted for llama-arch files."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    if vocab_key:
        w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in (extra or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float)
         else w.add_uint32)(key, value)
    for hf_name, (array, qtype, gname) in weights.items():
        if arch in ("llama", "mistral") and (".attn_q." in gname or ".attn_k." in gname):
            array = converter_permute(array, HEADS if ".attn_q." in gname else KV_HEADS)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(gname, gguf.quants.quantize(array, qtype))
        else:  # uint8: blocks already in qtype's bytes (a type gguf-py cannot quantize to)
            data = array if array.dtype == np.uint8 else gguf.quants.quantize(array, qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
    for gname, array in (extra_tensors or {}).items():
        w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path: Path, dtype=torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    config = gguf_hf_config(reader)
    return config, dict(iter_gguf_tensors(reader, config, dtype))


# --------------------------------------------------------------------------- tiny files

def test_llama_config_mapping(tmp_path):
    config, _ = load(write_gguf(tmp_path / "m.gguf", hf_weights()))
    assert config == {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "attention_bias": False, "rope_scaling": None,
        "bos_token_id": 0, "eos_token_id": 1}


def test_llama_tensors_names_shapes_and_values(tmp_path):
    """Every tensor comes back under its HF name, in HF shape, equal to the reference decode;
    q/k equal the un-permuted originals (q is F32, so exactly the original)."""
    weights = hf_weights(lm_head=True)
    config, tensors = load(write_gguf(tmp_path / "m.gguf", weights))
    assert config["tie_word_embeddings"] is False
    assert set(tensors) == set(weights)
    for hf_name, (array, qtype, _) in weights.items():
        assert tensors[hf_name].dtype == torch.float32
        np.testing.assert_array_equal(tensors[hf_name].numpy(), roundtrip(array, qtype), err_msg=hf_name)
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"].numpy(),
                                  weights["model.layers.1.self_attn.q_proj.weight"][0])


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_qk_unpermutation_round_trips(tmp_path, qtype):
    """Permuting rows commutes with row-wise quantization, so read-back == decode(original)."""
    weights = hf_weights(seed=3)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        weights[key] = (weights[key][0], qtype, weights[key][2])
    _, tensors = load(write_gguf(tmp_path / "m.gguf", weights))
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        original = weights[key][0]
        np.testing.assert_array_equal(tensors[key].numpy(), roundtrip(original, qtype))
        # the file really was permuted: reading it raw would not give the original back
        assert not np.array_equal(roundtrip(converter_permute(original, 2), qtype), roundtrip(original, qtype))


def test_mistral_is_named_from_general_name_and_unpermuted(tmp_path):
    weights = hf_weights(seed=4)
    config, tensors = load(write_gguf(tmp_path / "m.gguf", weights, name="Mistral-7B-Instruct-v0.3"))
    assert config["model_type"] == "mistral" and config["architectures"] == ["MistralForCausalLM"]
    key = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(tensors[key].numpy(), weights[key][0])


def test_qwen2_biases_and_no_permutation(tmp_path):
    weights = hf_weights(seed=5, arch="qwen2")
    config, tensors = load(write_gguf(tmp_path / "m.gguf", weights, arch="qwen2"))
    assert config["model_type"] == "qwen2" and config["attention_bias"] is True
    assert set(tensors) == set(weights)
    for key in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        np.testing.assert_array_equal(tensors[key].numpy(), weights[key][0])


def test_qwen3_qk_norm_and_key_length(tmp_path):
    weights = hf_weights(seed=6, arch="qwen3")
    path = write_gguf(tmp_path / "m.gguf", weights, arch="qwen3", extra={"qwen3.attention.key_length": 32})
    config, tensors = load(path)
    assert config["model_type"] == "qwen3" and config["attention_bias"] is False
    assert config["head_dim"] == 32  # key_length wins over hidden / heads
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (HEAD_DIM,)
    assert "model.layers.1.self_attn.k_norm.weight" in tensors


def test_vocab_size_falls_back_to_token_list(tmp_path):
    config, _ = load(write_gguf(tmp_path / "m.gguf", hf_weights(), vocab_key=False))
    assert config["vocab_size"] == VOCAB


def test_dtype_is_applied(tmp_path):
    _, tensors = load(write_gguf(tmp_path / "m.gguf", hf_weights()), dtype=torch.bfloat16)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), arch="phi3")
    with pytest.raises(ModelLoadError, match="phi3") as err:
        gguf_hf_config(open_gguf(path))
    assert all(a in str(err.value) for a in SUPPORTED_GGUF_ARCHS)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    weights = hf_weights()
    key = "model.layers.1.mlp.up_proj.weight"
    rows, cols = weights[key][0].shape
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((rows, cols // block * type_size), np.uint8)  # zero blocks of a type we lack
    weights[key] = (raw, Q.Q8_1, weights[key][2])
    reader = open_gguf(write_gguf(tmp_path / "m.gguf", weights))
    tensors = iter_gguf_tensors(reader, gguf_hf_config(reader))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*Q8_1") as err:
        next(tensors)  # fails before decoding anything
    assert all(t in str(err.value) for t in SUPPORTED_GGUF_TYPES)


def test_unknown_tensor_name(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(),
                      extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 32), np.float32)})
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        list(iter_gguf_tensors(reader, gguf_hf_config(reader)))


# --------------------------------------------------------------------------- rope scaling

def test_linear_rope_scaling_from_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(),
                      extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    assert gguf_hf_config(open_gguf(path))["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_scaling_recovered_exactly():
    """Llama 3.1 (head_dim 128, theta 5e5): the parameters come back exactly."""
    factors = _llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert llama3_scaling_from_factors(factors, 500000.0, 128) == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_from_rope_freqs_tensor(tmp_path):
    """Tiny head_dim: one medium frequency, so the parameters are not unique; whatever we
    return must reproduce llama.cpp's rope factors."""
    theta, dim = 500000.0, HEAD_DIM
    factors = _llama3_factors(theta, dim, 8.0, 1.0, 4.0, 64).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), rope_theta=theta,
                      extra_tensors={"rope_freqs.weight": factors})
    config, tensors = load(path)
    s = config["rope_scaling"]
    assert s["rope_type"] == "llama3" and s["factor"] == 8.0
    # not unique, but the search prefers round numbers and lands on the real ones here
    assert (s["high_freq_factor"], s["original_max_position_embeddings"]) == (4.0, 64)
    again = _llama3_factors(theta, dim, s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                            s["original_max_position_embeddings"])
    np.testing.assert_allclose(again, factors, rtol=1e-5)
    assert not any("rope" in name for name in tensors)  # not a model weight


def test_unscaled_rope_freqs_means_no_scaling():
    assert llama3_scaling_from_factors(np.ones(8, np.float32), 10000.0, 16) is None


# --------------------------------------------------------------------------- damaged files

def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_gguf("/nonexistent/model.gguf")


def test_directory_is_not_a_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="not a file"):
        open_gguf(tmp_path)


def test_truncated_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_weights())
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 40):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated") as err:
            open_gguf(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("prefix", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00"],
                         ids=["garbage", "magic-then-garbage", "header-then-garbage"])
def test_random_garbage(tmp_path, prefix):
    path = tmp_path / "junk.gguf"
    for seed in range(5):
        path.write_bytes(prefix + np.random.default_rng(seed).bytes(4096))
        with pytest.raises(ModelLoadError, match="not a GGUF file|corrupt") as err:
            open_gguf(path)
        assert str(path) in str(err.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        open_gguf(path)


# --------------------------------------------------------------------------- the embedded model

@pytest.fixture(scope="module")
def smollm_reader(gguf_path):
    return open_gguf(gguf_path)


def test_embedded_config(smollm_reader):
    config = gguf_hf_config(smollm_reader)
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"] is None and config["intermediate_size"] == 1536


@pytest.mark.slow  # transformers parsing the file: ~30 s, once a session (conftest.hf_gguf_model)
def test_embedded_weights_match_transformers(hf_gguf_model, smollm_reader):
    """transformers dequantizes with gguf's numpy reference and un-permutes q/k its own way."""
    reference = hf_gguf_model.state_dict()
    ours = dict(iter_gguf_tensors(smollm_reader, gguf_hf_config(smollm_reader)))
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied to embed_tokens by HF
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)
    assert math.isclose(ours["model.norm.weight"].abs().sum().item(),
                        reference["model.norm.weight"].abs().sum().item())
