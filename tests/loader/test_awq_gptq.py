"""AWQ / GPTQ int4 and FP8 checkpoints (memwall/loader/hf_quantized.py), against transformers.

No quantization library is needed: the test quantizes a tiny random Llama itself (round to
nearest per group, with zero points) and packs qweight/qzeros/scales/g_idx exactly as AutoAWQ
(WQLinear_GEMM.from_linear) and AutoGPTQ (QuantLinear.pack) write them, with the
``quantization_config`` those tools put in config.json. The oracle is transformers' model with
the DEQUANTIZED float weights put back: int4 weights reach our kernels bit for bit, so the logits
differ only by summation order (exact fp32 kernels), and greedy tokens must be equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from memwall.attention.metadata import AttentionMetadata
from memwall.loader.errors import ModelLoadError
from memwall.loader.hf_quantized import (AWQ_ORDER, awq_codes, dequantize_codes, gptq_codes,
                                         int4_weights, unpack_awq, unpack_rows)
from memwall.loader.model_loader import load_model
from memwall.quant.act_order import PermutedInput
from memwall.quant.base import QuantLinear
from memwall.quant.int4_cpu import NativeQ4
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

ATOL = RTOL = 1e-4  # as tests/models/test_forward_parity.py: the weights are the oracle's exactly
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [(i * 37 + 11) % 300 + 4 for i in range(24)]
pytestmark = pytest.mark.usefixtures("exact_kernels")


# --------------------------------------------------------------------------- a float model

@pytest.fixture(scope="module")
def base_dir(tiny_model_dir, tmp_path_factory):
    """kind -> a saved tiny float model (conftest's, widened to hidden 128 for groups of 128)."""
    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            directory = tmp_path_factory.mktemp(f"float-{kind}")
            cache[kind] = _build_base(directory, tiny_model_dir(kind))
        return cache[kind]

    return make


def _build_base(directory: Path, tiny: Path) -> Path:
    import transformers

    torch.manual_seed(4321)
    config = transformers.AutoConfig.from_pretrained(tiny)
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, as conftest's models
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    for f in tiny.glob("tokenizer*"):
        shutil.copy(f, directory / f.name)
    return directory


def _hf_model(base: Path, weights: dict[str, torch.Tensor]):
    """transformers' model with ``weights`` (module -> float [out, in]) substituted."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        for module, w in weights.items():
            model.get_submodule(module).weight.copy_(w)
    return model


# --------------------------------------------------------------------------- our quantizers

def rtn(w: torch.Tensor, group: int, sym: bool = False, min_zero: int = 0):
    """Round to nearest per group of ``group`` consecutive inputs, as AutoGPTQ's Quantizer
    (min/max including 0, 15 steps; sym: zero 8): (q uint8 [out, in], z, s [out, G]) with
    fp16 scales, as the checkpoints store them."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    s = ((hi - lo) / 15).clamp(min=1e-4).half().float()  # [out, G]
    z = torch.full_like(s, 8.0) if sym else torch.round(-lo / s).clamp(min_zero, 15)
    q = (torch.round(g / s[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), z, s


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32-1 -> int32 with the same bits (what the tools store)."""
    return ((x + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack8(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibbles -> [...] int32, nibble i at bits 4i."""
    shifts = torch.arange(0, 32, 4)
    return _int32((values.long() << shifts).sum(-1))


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8] as AutoAWQ's pack: slot i holds column 8j + AWQ_ORDER[i]."""
    r, c = codes.shape
    return _pack8(codes.reshape(r, c // 8, 8)[..., list(AWQ_ORDER)])


def pack_gptq_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8], values in order along C (AutoGPTQ's qzeros)."""
    r, c = codes.shape
    return _pack8(codes.reshape(r, c // 8, 8))


def awq_tensors(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], tuple]:
    q, z, s = rtn(w, group)
    tensors = {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t().to(torch.uint8)),
               "scales": s.t().half().contiguous()}
    return tensors, (q, z, s, torch.arange(w.shape[1]) // group)


def gptq_tensors(w: torch.Tensor, group: int, sym: bool, v2: bool,
                 perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], tuple]:
    """AutoGPTQ's layout. ``perm`` (act-order): the input channels are quantized in that
    order, so group j holds channels perm[j*group:(j+1)*group] and g_idx[perm[i]] = i // group."""
    n, k = w.shape
    group = k if group == -1 else group
    perm = torch.arange(k) if perm is None else perm
    qp, z, s = rtn(w[:, perm], group, sym, min_zero=0 if v2 else 1)  # v1 stores zero - 1 >= 0
    q = torch.empty_like(qp)
    q[:, perm] = qp
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // group
    qweight = _pack8(q.t().reshape(k // 8, 8, n).transpose(1, 2))  # [in/8, out]
    stored_z = z.t().to(torch.uint8) - (0 if v2 else 1)
    tensors = {"qweight": qweight, "qzeros": pack_gptq_rows(stored_z), "scales": s.t().half(),
               "g_idx": g_idx.to(torch.int32)}
    return {k_: t.contiguous() for k_, t in tensors.items()}, (q, z, s, g_idx)


# --------------------------------------------------------------------------- checkpoints

AWQ_CASES = {f"awq-g{g}": dict(method="awq", group=g) for g in (32, 64, 128)}
GPTQ_CASES = {
    "gptq-g128": dict(method="gptq", group=128, act_order=False, sym=False, v2=False),
    "gptq-g32-act-order": dict(method="gptq", group=32, act_order=True, sym=False, v2=False),
    "gptq-g64-act-order-sym-v2": dict(method="gptq", group=64, act_order=True, sym=True, v2=True),
    "gptq-per-channel": dict(method="gptq", group=-1, act_order=False, sym=True, v2=False),
    # a perm per Linear, not per input: q/k/v and gate/up cannot join (a ConcatLinear)
    "gptq-qwen2-act-order": dict(method="gptq", group=32, act_order=True, sym=False, v2=False,
                                 kind="qwen2", perm_per_linear=True),
}
FP8_CASES = {
    "fp8-per-tensor": dict(method="fp8", scale="tensor"),
    "fp8-per-channel": dict(method="fp8", scale="channel"),
    "fp8-blocks": dict(method="fp8", scale="block"),
}
CASES = {**AWQ_CASES, **GPTQ_CASES, **FP8_CASES}


def quantization_config(case: dict) -> dict:
    """As AutoAWQ / AutoGPTQ / AutoFP8 / fbgemm write it into config.json."""
    if case["method"] == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case["group"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if case["method"] == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": case["group"],
                "desc_act": case["act_order"], "sym": case["sym"], "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False, "model_name_or_path": None,
                "model_file_base_name": None,
                "checkpoint_format": "gptq_v2" if case["v2"] else "gptq"}
    if case["scale"] == "channel":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}
    if case["scale"] == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [32, 32]}
    return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}


def fp8_tensors(w: torch.Tensor, scale: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tensors, dequantized float weight) of one Linear."""
    n, k = w.shape
    if scale == "block":
        amax = w.abs().reshape(n // 32, 32, k // 32, 32).amax((1, 3))  # [n/32, k/32]
        s = amax / 448
        full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": s}, q.float() * full
    s = w.abs().amax() / 448 if scale == "tensor" else w.abs().amax(1, keepdim=True) / 448
    q = (w / s).to(torch.float8_e4m3fn)
    tensors = {"weight": q, "weight_scale": s.float()}
    if scale == "tensor":
        tensors["input_scale"] = torch.tensor(0.05)  # static activation scale: not used
    return tensors, q.float() * s


@pytest.fixture(scope="module")
def checkpoint(base_dir, tmp_path_factory):
    """name -> (quantized checkpoint dir, base float dir, {module: dequantized float weight},
    {module: (q, z, s, g_idx) as quantized}), built once per case."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            cache[name] = _write_checkpoint(tmp_path_factory.mktemp(name), base_dir, CASES[name])
        return cache[name]

    return make


def _write_checkpoint(directory: Path, base_dir, case: dict):
    from safetensors.torch import load_file

    base = base_dir(case.get("kind", "llama"))
    state = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    dequantized, codes, out, perms = {}, {}, {}, {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rsplit(".", 1)[-1] not in LINEARS:
            out[name] = t
            continue
        if case["method"] == "fp8":
            tensors, dequantized[module] = fp8_tensors(t, case["scale"])
        else:
            if case["method"] == "awq":
                tensors, codes[module] = awq_tensors(t, case["group"])
            else:
                perm = None
                if case["act_order"]:  # GPTQ orders a shared input's channels once (q/k/v)
                    shared = module if case.get("perm_per_linear") else _input_of(module)
                    perm = perms.setdefault(shared, torch.randperm(t.shape[1], generator=gen))
                tensors, codes[module] = gptq_tensors(t, case["group"], case["sym"], case["v2"],
                                                      perm)
            dequantized[module] = dequantize_codes(*codes[module])
        out.update({f"{module}.{k}": v for k, v in tensors.items()})
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(case)
    (directory / "config.json").write_text(json.dumps(cfg))
    for f in base.glob("tokenizer*"):
        shutil.copy(f, directory / f.name)
    return directory, base, dequantized, codes


def _input_of(module: str) -> str:
    """Linears that read the same activations: q/k/v, and gate/up."""
    for leaves, shared in ((("q_proj", "k_proj", "v_proj"), "qkv"),
                           (("gate_proj", "up_proj"), "gate_up")):
        for leaf in leaves:
            module = module.replace(leaf, shared)
    return module


# --------------------------------------------------------------------------- (a) packing

def test_packing_round_trips():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_awq(pack_awq(codes)), codes)
    assert torch.equal(unpack_rows(pack_gptq_rows(codes)), codes)
    # AutoAWQ's slots: column 8j+1 sits at bits 16..19, column 8j+2 at bits 4..7
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 1] = 15
    assert pack_awq(one).item() == 15 << 16
    one[0, 1], one[0, 2] = 0, 15
    assert pack_awq(one).item() == 15 << 4


@pytest.mark.parametrize("name", [*AWQ_CASES, *GPTQ_CASES])
def test_unpacked_codes_equal_the_packed_ones(checkpoint, name):
    from safetensors.torch import load_file

    path, _, _, codes = checkpoint(name)
    state = load_file(str(path / "model.safetensors"))
    case = CASES[name]
    for module, (q, z, s, g_idx) in codes.items():
        parts = [state.get(f"{module}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")]
        if case["method"] == "awq":
            got = awq_codes(*parts[:3], case["group"])
        else:
            got = gptq_codes(*parts, case["group"], zero_offset=0 if case["v2"] else 1)
        for a, b in zip(got, (q, z, s, g_idx)):
            assert torch.equal(a, b.to(a.dtype)), module


# --------------------------------------------------------------------- (b) logits, (d) kernels

@torch.no_grad()
def our_logits(loaded, ids):
    plan = KVCachePlan(num_blocks=16, block_size=16, bytes_per_block=0)
    caches = allocate_kv_cache(loaded.arch, plan, torch.float32)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(16))], 16)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_logits_match_transformers_with_dequantized_weights(checkpoint, name):
    path, base, dequantized, _ = checkpoint(name)
    reference = _hf_model(base, dequantized)(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(str(path))
    torch.testing.assert_close(our_logits(loaded, PROMPT), reference, atol=ATOL, rtol=RTOL)


def _weight_of(module: nn.Module) -> torch.Tensor:
    """The float weight [out, in] a layer multiplies by (its output for the identity, the
    bias left out)."""
    bias, module.bias = module.bias, None
    try:
        return module(torch.eye(module.in_features)).t()
    finally:
        module.bias = bias


@pytest.mark.parametrize("name", [*AWQ_CASES, *GPTQ_CASES])
@torch.no_grad()
def test_int4_checkpoints_stay_int4_with_exact_weights(checkpoint, name):
    path, _, dequantized, _ = checkpoint(name)
    loaded = load_model(str(path))
    case = CASES[name]
    act_order = case.get("act_order", False)
    for i, layer in enumerate(loaded.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for module, parts, parent in (
                (attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), "self_attn"),
                (attn.o_proj, ("o_proj",), "self_attn"),
                (mlp.gate_up_proj, ("gate_proj", "up_proj"), "mlp"),
                (mlp.down_proj, ("down_proj",), "mlp")):
            joined = len(parts) == 1 or not case.get("perm_per_linear")
            quantized = [module] if joined else list(module.parts)  # else a ConcatLinear
            for q in quantized:
                assert isinstance(q, QuantLinear), q
                assert isinstance(q.method, PermutedInput) == act_order
                assert isinstance(q.method.inner if act_order else q.method, NativeQ4)
            expected = torch.cat([dequantized[f"model.layers.{i}.{parent}.{p}"] for p in parts])
            torch.testing.assert_close(_weight_of(module), expected, atol=0, rtol=0)
    assert type(loaded.model.lm_head) is nn.Linear  # the head stays float, as published


def test_fp8_checkpoint_dequantizes_on_the_cpu(checkpoint):
    path, _, dequantized, _ = checkpoint("fp8-per-channel")
    loaded = load_model(str(path))
    o_proj = loaded.model.model.layers[0].self_attn.o_proj
    assert type(o_proj) is nn.Linear
    assert torch.equal(o_proj.weight, dequantized["model.layers.0.self_attn.o_proj"])


@pytest.mark.parametrize("name", ["fp8-per-tensor", "fp8-per-channel"])
@torch.no_grad()
def test_fp8_stays_fp8_where_fp8_matmuls_run(checkpoint, monkeypatch, name):
    """On a CUDA device with FP8 tensor cores the weights stay Fp8Linear (torch._scaled_mm);
    here that decision is forced, and Fp8Linear's CPU path multiplies the same numbers."""
    from memwall.loader import hf_quantized
    from memwall.quant.fp8 import Fp8Linear

    monkeypatch.setattr(hf_quantized, "fp8_gpu", lambda: True)
    path, base, dequantized, _ = checkpoint(name)
    loaded = load_model(str(path))
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and isinstance(qkv.method, Fp8Linear)
    assert qkv.qweight.dtype == torch.float8_e4m3fn
    reference = _hf_model(base, dequantized)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(our_logits(loaded, PROMPT), reference, atol=ATOL, rtol=RTOL)


def test_quantization_none_dequantizes_int4(checkpoint):
    path, _, dequantized, _ = checkpoint("gptq-g32-act-order")
    loaded = load_model(str(path), quantization="none")
    down = loaded.model.model.layers[1].mlp.down_proj
    assert type(down) is nn.Linear
    assert torch.equal(down.weight, dequantized["model.layers.1.mlp.down_proj"])


# --------------------------------------------------------------------------- (c) greedy tokens

@pytest.mark.parametrize("name", ["awq-g64", "gptq-g128", "gptq-g32-act-order",
                                  "gptq-qwen2-act-order", "fp8-per-tensor"])
@torch.no_grad()
def test_greedy_tokens_match_transformers(checkpoint, name):
    from memwall import LLM, SamplingParams

    path, base, dequantized, _ = checkpoint(name)
    ref = _hf_model(base, dequantized).generate(
        torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
        pad_token_id=0)[0, len(PROMPT):].tolist()
    llm = LLM(str(path), num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref


# --------------------------------------------------------------------------- torch fallback, errors

@pytest.mark.parametrize("backend", ["native", "torch"])
def test_act_order_layer_matches_the_dequantized_matmul(backend):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen)
    perm = torch.randperm(128, generator=gen)
    tensors, _ = gptq_tensors(w, 32, sym=False, v2=False, perm=perm)
    q, z, s, g_idx = gptq_codes(tensors["qweight"], tensors["qzeros"], tensors["scales"],
                                tensors["g_idx"], 32, zero_offset=1)
    layer = QuantLinear(int4_weights(q, z, s, g_idx, "test", backend))
    assert isinstance(layer.method, PermutedInput)
    x = torch.randn(5, 128, generator=gen)
    expected = F.linear(x, dequantize_codes(q, z, s, g_idx))
    tol = 1e-5 if backend == "native" else 3e-2  # torch's op: bf16 activations and scales
    torch.testing.assert_close(layer(x), expected, atol=tol * expected.abs().max(), rtol=tol)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
])
def test_unsupported_quantization_config_is_one_line(base_dir, tmp_path, qc, words):
    base = base_dir("llama")
    for f in base.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert words in message and "\n" not in message
    assert "group_size 16" in message or "supported: awq" in message


def test_a_group_size_the_tensors_do_not_have_is_one_line(checkpoint, tmp_path):
    path, _, _, _ = checkpoint("awq-g64")
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 32  # the scales hold groups of 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"do not fit together \(group_size 32\)$"):
        load_model(str(tmp_path))
