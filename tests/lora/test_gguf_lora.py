"""GGUF LoRA adapters (memwall/lora/gguf_lora.py), written here as llama.cpp's
convert_lora_to_gguf.py writes them, and checked against the HF-layout weights they came from
and, end to end, against a PEFT model's own LoRA deltas.

What the converter does, which ``write_lora`` repeats:
  general.type "adapter", adapter.type "lora", adapter.lora.alpha (f32), general.architecture;
  blk.N.<part>.weight.lora_a = PEFT lora_A [r, in], .lora_b = PEFT lora_B [out, r] (numpy order);
  for llama-arch files, B of q/k has its rows permuted by LlamaModel.permute (n_head for q,
  n_head_kv for k), A untouched: the converter runs the base class's modify_tensors on a lazy
  (A, B) pair whose permute() only moves B's rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from memwall.lora.adapter import TARGETS, LoRAError
from memwall.lora.gguf_lora import load_gguf_lora

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
BASE_CONFIG = {"model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}

# HF target -> (GGUF part, in, out)
PARTS = {"q_proj": ("attn_q", HIDDEN, HEADS * HEAD_DIM),
         "k_proj": ("attn_k", HIDDEN, KV_HEADS * HEAD_DIM),
         "v_proj": ("attn_v", HIDDEN, KV_HEADS * HEAD_DIM),
         "o_proj": ("attn_output", HEADS * HEAD_DIM, HIDDEN),
         "gate_proj": ("ffn_gate", HIDDEN, FFN), "up_proj": ("ffn_up", HIDDEN, FFN),
         "down_proj": ("ffn_down", FFN, HIDDEN)}


def module_name(layer: int, target: str) -> str:
    parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{parent}.{target}"


def gguf_name(module: str) -> str:
    """model.layers.3.self_attn.q_proj -> blk.3.attn_q.weight"""
    parts = module.split(".")
    return f"blk.{parts[2]}.{PARTS[parts[4]][0]}.weight"


def converter_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader must get back from ``w`` written as ``qtype``."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def random_modules(seed: int, rank: int = 8, ranks: dict[str, int] | None = None) -> dict[str, tuple]:
    """{hf module: (A [r, in], B [out, r])} float32 for every target of every layer."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(LAYERS):
        for target, (_, k, n) in PARTS.items():
            module = module_name(layer, target)
            r = (ranks or {}).get(module, rank)
            out[module] = (rng.standard_normal((r, k)).astype(np.float32),
                           rng.standard_normal((n, r)).astype(np.float32))
    return out


def write_lora(path: Path, modules: dict[str, tuple], *, arch: str = "llama",
               alpha: float | str | None = 16.0,
               types: dict[str, Q] | None = None, general_type: str | None = "adapter",
               adapter_type: str = "lora", extra_kv: dict | None = None,
               extra_tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None) -> Path:
    """``modules`` ({hf module: (A, B)}, HF layout) written as convert_lora_to_gguf.py would.

    ``types``: {"a"/"b"/hf module + ".a"/".b": qtype} (default F32). As the converter, a Q8_0
    tensor whose last axis is not a multiple of 32 falls back to F16.
    """
    w = gguf.GGUFWriter(str(path), arch)
    if general_type is not None:
        w.add_type(general_type)
    w.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if isinstance(alpha, str):
        w.add_string(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    elif alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, (value, vtype) in (extra_kv or {}).items():
        sub_type = gguf.GGUFValueType.UINT32 if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type)
    types = types or {}
    for module, (a, b) in modules.items():
        name = gguf_name(module)
        if arch in ("llama", "mistral") and module.endswith(("q_proj", "k_proj")):
            b = converter_permute(b, HEADS, HEADS if module.endswith("q_proj") else KV_HEADS)
        for half, array in (("a", a), ("b", b)):
            qtype = types.get(f"{module}.{half}", types.get(half, Q.F32))
            add(w, f"{name}.lora_{half}", array, qtype)
    for name, (array, qtype) in (extra_tensors or {}).items():
        add(w, name, array, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add(w: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q | None) -> None:
    if qtype is None:  # raw bytes of a type given by the caller's dtype
        w.add_tensor(name, array)
    elif qtype == Q.Q8_0 and array.shape[-1] % 32:
        w.add_tensor(name, gguf.quants.quantize(array, Q.F16))  # the converter's fallback
    elif qtype in (Q.F32, Q.F16):
        w.add_tensor(name, gguf.quants.quantize(array, qtype))
    else:
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def stored(array: np.ndarray, qtype: Q) -> np.ndarray:
    """The values a tensor of ``qtype`` holds (row permutations commute with this: blocks run
    along rows)."""
    if qtype == Q.Q8_0 and array.shape[-1] % 32:
        qtype = Q.F16
    return array if qtype == Q.F32 else roundtrip(array, qtype)


# --------------------------------------------------------------------------- HF layout back

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_come_back_in_hf_layout_with_the_scale_folded_in(tmp_path, arch):
    """A and B*alpha/r (r per module) in HF layout: llama's q/k B un-permuted, qwen2's as stored.
    Types: A F16, B F32, one module BF16, one Q8_0 (A Q8_0, B's r=8 falls back to F16), and a
    rank-32 module whose A and B are both Q8_0."""
    q0, o1, k1 = module_name(0, "q_proj"), module_name(1, "o_proj"), module_name(1, "k_proj")
    modules = random_modules(1, ranks={o1: 4, k1: 32})
    types = {"a": Q.F16, "b": Q.F32, f"{q0}.a": Q.BF16, f"{q0}.b": Q.BF16,
             f"{o1}.a": Q.Q8_0, f"{o1}.b": Q.Q8_0, f"{k1}.a": Q.Q8_0, f"{k1}.b": Q.Q8_0}
    path = write_lora(tmp_path / "a.gguf", modules, arch=arch, alpha=16.0, types=types)
    adapter = load_gguf_lora(str(path), "ad", {**BASE_CONFIG, "model_type": arch})

    assert adapter.name == "ad" and adapter.path == str(path)
    assert adapter.rank == 32
    assert adapter.content_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(adapter.modules) == sorted(modules)
    for module, (a, b) in modules.items():
        qa = types.get(f"{module}.a", types["a"])
        qb = types.get(f"{module}.b", types["b"])
        got = adapter.modules[module]
        r = a.shape[0]
        assert got.a.dtype == got.b.dtype == torch.float32
        assert torch.equal(got.a, torch.from_numpy(stored(a, qa))), module
        assert torch.equal(got.b, torch.from_numpy(stored(b, qb)) * (16.0 / r)), module


def test_llama_q_and_k_lora_b_are_really_permuted_in_the_file(tmp_path):
    """The test above would prove nothing if the permutation were the identity; and the k
    permutation uses n_head_kv (2), not n_head (4)."""
    _, b = random_modules(2)[module_name(0, "k_proj")]
    assert not np.array_equal(converter_permute(b, HEADS, KV_HEADS), b)
    assert not np.array_equal(converter_permute(b, HEADS, KV_HEADS), converter_permute(b, HEADS))
    module = module_name(0, "k_proj")
    path = write_lora(tmp_path / "k.gguf", {module: random_modules(2)[module]})
    reader = gguf.GGUFReader(str(path))
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight.lora_b").data
    assert np.array_equal(raw, converter_permute(b, HEADS, KV_HEADS))


def test_missing_or_zero_alpha_means_no_scaling_as_in_llama_cpp(tmp_path):
    """llama.cpp: scale = alpha ? alpha / rank : 1, and a missing key reads as alpha 0."""
    modules = random_modules(3, rank=8)
    for alpha in (None, 0.0):
        path = write_lora(tmp_path / f"{alpha}.gguf", modules, arch="qwen2", alpha=alpha)
        adapter = load_gguf_lora(str(path), "ad")
        for module, (a, b) in modules.items():
            assert torch.equal(adapter.modules[module].b, torch.from_numpy(b))


def test_head_counts_from_file_metadata_when_no_base_config(tmp_path):
    modules = random_modules(4)
    path = write_lora(tmp_path / "h.gguf", modules, extra_kv={
        "llama.attention.head_count": (HEADS, gguf.GGUFValueType.UINT32),
        "llama.attention.head_count_kv": (KV_HEADS, gguf.GGUFValueType.UINT32)})
    adapter = load_gguf_lora(str(path), "ad")
    for module, (_, b) in modules.items():
        assert torch.equal(adapter.modules[module].b, torch.from_numpy(b) * 2.0)


def test_llama_adapter_without_q_or_k_needs_no_head_counts(tmp_path):
    modules = {m: ab for m, ab in random_modules(5).items() if not m.endswith(("q_proj", "k_proj"))}
    adapter = load_gguf_lora(str(write_lora(tmp_path / "v.gguf", modules)), "ad")
    assert sorted(adapter.modules) == sorted(modules)


# --------------------------------------------------------------------------- PEFT end to end

def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                         max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def test_peft_adapter_converted_the_llama_cpp_way_matches_peft(tmp_path):
    """A PEFT LoRA on a tiny random Llama (GQA, so k's permutation differs from q's), its
    tensors written as convert_lora_to_gguf.py writes them: every module's x A^T B^T is PEFT's
    lora_B(lora_A(x)) * scaling, and merging them into the base weights gives the PEFT model's
    logits."""
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    base_config = base.config.to_dict()
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS),
                           init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, lora).eval()
    state = peft.get_peft_model_state_dict(model)
    modules = {}
    for key, tensor in state.items():  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
        module, half = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        a, b = modules.get(module, (None, None))
        t = tensor.detach().float().numpy()
        modules[module] = (t, b) if half == "A.weight" else (a, t)
    assert len(modules) == LAYERS * len(TARGETS)
    path = write_lora(tmp_path / "peft.gguf", modules, alpha=16.0)

    adapter = load_gguf_lora(str(path), "peft", base_config)
    x = torch.randn(5, FFN)
    peft_modules = dict(model.base_model.model.named_modules())
    with torch.no_grad():
        for module, w in adapter.modules.items():
            layer = peft_modules[module]
            xin = x[:, :layer.in_features]
            expected = layer.lora_B["default"](layer.lora_A["default"](xin)) * layer.scaling["default"]
            torch.testing.assert_close(xin @ w.a.T @ w.b.T, expected, rtol=1e-5, atol=1e-5)

        tokens = torch.tensor([[1, 5, 9, 200, 17, 3]])
        want = model(tokens).logits
        merged = tiny_llama()
        for module, w in adapter.modules.items():
            base_weights[f"{module}.weight"] += w.b @ w.a
        merged.load_state_dict(base_weights)
        torch.testing.assert_close(merged(tokens).logits, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- refusals

def one_module(target: str = "v_proj", r: int = 8) -> dict[str, tuple]:
    module = module_name(0, target)
    _, k, n = PARTS[target]
    return {module: (np.ones((r, k), np.float32), np.ones((n, r), np.float32))}


def refused(path: Path, match: str, base_config: dict | None = BASE_CONFIG) -> str:
    with pytest.raises(LoRAError, match=match) as info:
        load_gguf_lora(str(path), "ad", base_config)
    message = str(info.value)
    assert message.startswith("adapter 'ad'") and "\n" not in message
    return message


def test_model_gguf_is_not_an_adapter(tmp_path):
    refused(write_lora(tmp_path / "m.gguf", one_module(), general_type=None),
            r"has no general.type, not 'adapter'")
    refused(write_lora(tmp_path / "m2.gguf", one_module(), general_type="model"),
            r"has general.type 'model', not 'adapter'")


def test_not_lora_type(tmp_path):
    refused(write_lora(tmp_path / "c.gguf", one_module(), adapter_type="control_vector"),
            r"adapter.type is 'control_vector', not 'lora'")


def test_alora_is_refused(tmp_path):
    path = write_lora(tmp_path / "al.gguf", one_module(), extra_kv={
        gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS: ([5, 6], gguf.GGUFValueType.ARRAY)})
    refused(path, r"aLoRA.*not supported")


def test_alpha_that_is_not_a_number(tmp_path):
    refused(write_lora(tmp_path / "s.gguf", one_module(), alpha="16"),
            r"adapter.lora.alpha is a string, not a number")


def test_unsupported_architecture_and_wrong_base_model(tmp_path):
    refused(write_lora(tmp_path / "p.gguf", one_module(), arch="phi3"), r"general.architecture is 'phi3'")
    refused(write_lora(tmp_path / "q.gguf", one_module(), arch="qwen2"),
            r"is for a 'qwen2' model, but the served model is 'llama'")


@pytest.mark.parametrize("drop", ["b", "a"])
def test_lora_a_without_lora_b_and_the_reverse(tmp_path, drop):
    path = tmp_path / "half.gguf"
    a, b = one_module()[module_name(0, "v_proj")]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 16.0)
    have = "a" if drop == "b" else "b"
    w.add_tensor(f"blk.0.attn_v.weight.lora_{have}", a if have == "a" else b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(path, rf"blk\.0\.attn_v\.weight\.lora_{have} has no blk\.0\.attn_v\.weight\.lora_{drop}")


def test_mismatched_rank(tmp_path):
    module = module_name(0, "v_proj")
    a, b = one_module()[module]
    path = write_lora(tmp_path / "r.gguf", {module: (a, b[:, :4].copy())})
    refused(path, r"blk\.0\.attn_v\.weight\.lora_a is \[8, 64\] and blk\.0\.attn_v\.weight\.lora_b is "
                  r"\[32, 4\] \(numpy order\); they must be \[r, in\] and \[out, r\] with the same r")


@pytest.mark.parametrize("tensor, match", [
    ("blk.0.attn_norm.weight", r"tensor 'blk\.0\.attn_norm\.weight' is not a LoRA tensor"),  # mergekit norms
    ("token_embd.weight.lora_a", r"tensor 'token_embd\.weight\.lora_a' targets 'token_embd\.weight'"),
    ("output.weight.lora_b", r"tensor 'output\.weight\.lora_b' targets 'output\.weight'"),
    ("blk.0.attn_q_norm.weight.lora_a", r"tensor 'blk\.0\.attn_q_norm\.weight\.lora_a' targets"),
    ("blk.0.attn_q.bias.lora_a", r"tensor 'blk\.0\.attn_q\.bias\.lora_a' targets"),
    ("blk.0.ffn_gate_exps.weight.lora_a", r"tensor 'blk\.0\.ffn_gate_exps\.weight\.lora_a' targets"),
])
def test_unknown_tensor_names(tmp_path, tensor, match):
    path = write_lora(tmp_path / "u.gguf", one_module(),
                      extra_tensors={tensor: (np.ones((8, 64), np.float32), Q.F32)})
    message = refused(path, match)
    assert "attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down" in message or "norm" in message


def test_unsupported_tensor_type(tmp_path):
    module = module_name(0, "v_proj")
    a, b = one_module()[module]
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_tensor("blk.0.attn_v.weight.lora_a", np.zeros((8, 2 * 40), np.uint8), raw_dtype=Q.Q8_1)
    w.add_tensor("blk.0.attn_v.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(path, r"tensor 'blk\.0\.attn_v\.weight\.lora_a' has type Q8_1, which memwall cannot read "
                  r"\(supported: F32, F16, BF16, Q8_0")


def test_llama_q_k_need_head_counts(tmp_path):
    path = write_lora(tmp_path / "q.gguf", one_module("q_proj"))
    refused(path, r"q/k lora_b must be un-permuted with the base model's head counts, and no base "
                  r"config with num_attention_heads was given", base_config=None)
    refused(path, r"q_proj lora_b has 64 rows, which 3 heads cannot split",
            base_config={"num_attention_heads": 3})


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    refused(tmp_path / "x.gguf", r"is not a GGUF file")
    refused(tmp_path / "missing.gguf", r"does not exist")


def test_no_lora_tensors(tmp_path):
    refused(write_lora(tmp_path / "e.gguf", {}), r"holds no LoRA tensors")
