"""GGUF Q2_K, Q3_K, IQ4_NL and IQ4_XS: decoded bit for bit as gguf-py does, and kept quantized.

Random blocks (random codes and scale bytes, fp16 scale fields random finite values of either
sign) reach every code and every packed scale. Native backend: the layer's s * q + c is the
reference weight bit for bit, so its matmul differs from F.linear only by fp32 summation order.
Torch backend: dequantized and requantized to per-channel int8 (bf16 op), a loose check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter, quants

from memwall.kernels.cpu import build, quant_ops
from memwall.kernels.cpu.layout import float_table, scale_format, table_groups
from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf
from memwall.loader.gguf_weights import SUPPORTED_GGUF_TYPES, dequantize
from memwall.quant.base import QuantLinear
from memwall.quant.gguf_repack import REPACKABLE, gguf_quantized_linears, repack
from tests.loader.test_gguf_loader import hf_weights, write_gguf

TYPES = [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS]
# byte offsets of each block's fp16 fields (d, and dmin for Q2_K)
F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0]}
ROWS, COLS = 48, 512
native = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the native kernels")


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks; fp16 fields +-[1e-3, 1e-1] (finite, no NaN)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = rng.uniform(1e-3, 1e-1, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])
        raw[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_types_are_supported_and_repackable():
    assert {q.name for q in TYPES} <= set(SUPPORTED_GGUF_TYPES)
    assert set(TYPES) <= set(REPACKABLE)


# --------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_is_gguf_py_bit_for_bit(qtype, seed):
    raw = random_blocks(qtype, ROWS, COLS, seed)  # 96 super-blocks, or 768 IQ4_NL blocks
    ours = dequantize(raw, qtype, (ROWS, COLS)).numpy()
    ref = quants.dequantize(raw, qtype).reshape(ROWS, COLS)
    assert ours.dtype == np.float32 and np.isfinite(ref).all()
    assert np.array_equal(ours, ref)
    assert np.array_equal(np.signbit(ours), np.signbit(ref))  # even the zeros' signs


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_flat_bytes_and_three_dims(qtype):
    raw = random_blocks(qtype, 6, 256, seed=3)
    shape = (2, 3, 256)
    ref = quants.dequantize(raw, qtype).reshape(shape)
    assert np.array_equal(dequantize(raw.reshape(-1), qtype, shape).numpy(), ref)


def test_iq4_nl_hand_built_block():
    """Independent of the reference: low nibbles are values 0..15, high nibbles 16..31, and a
    code picks a level of ggml's kvalues_iq4nl."""
    levels = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0.5], dtype=np.float16).view(np.uint8), qs])
    expected = [0.5 * levels[j] for j in range(16)] + [0.5 * levels[15 - j] for j in range(16)]
    assert dequantize(block, Q.IQ4_NL, (32,)).tolist() == expected


def test_q3_k_hand_built_block():
    """All scales 33 (value d * 1 * q); code 2 with its hmask bit set is 2, clear is 2 - 4."""
    block = np.zeros(110, np.uint8)
    block[0:32] = 0x55  # hmask: bit j set for even j, i.e. values 0..31, 64..95, ...
    block[32:96] = 0xAA  # every 2-bit code is 2
    block[96:104] = 0x11  # low nibbles 1 of scales 0..15
    block[104:108] = 0xAA  # top bits 2: scale 0b100001 = 33
    block[108:110] = np.array([0.25], np.float16).view(np.uint8)
    expected = [0.25 * (2 if (v // 32) % 2 == 0 else -2) for v in range(256)]
    assert dequantize(block, Q.Q3_K, (256,)).tolist() == expected


# --------------------------------------------------------------------------- kept quantized

@native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_weights_are_the_reference_weights(qtype):
    """The kernel rebuilds each weight as s * q + c (multiply, then add, no FMA): so does this."""
    raw = random_blocks(qtype, ROWS, COLS, seed=5)
    weights = repack(raw, qtype, (ROWS, COLS), backend="native")
    t = weights.tensors
    group = COLS // table_groups(t["s"])
    assert group == (16 if qtype in (Q.Q2_K, Q.Q3_K) else 32)
    # the K-quants keep ggml's two levels (a float32 d per 256 values, an int8 sub-scale a group)
    assert scale_format(t["s"]) == scale_format(t["c"]) == {Q.Q2_K: 16, Q.Q3_K: 16, Q.IQ4_XS: 8}.get(qtype, 1)
    s, c = (float_table(t[k]).repeat_interleave(group, dim=1) for k in ("s", "c"))
    rebuilt = t["codes"].float() * s + c
    assert torch.equal(rebuilt, dequantize(raw, qtype, (ROWS, COLS)))
    assert weights.source == f"gguf {qtype.name}"


@native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_native_matmul_matches_reference(qtype, tokens, exact_kernels):
    raw = random_blocks(qtype, ROWS, COLS, seed=int(qtype))
    w = dequantize(raw, qtype, (ROWS, COLS))
    layer = QuantLinear(repack(raw, qtype, (ROWS, COLS), backend="native"))
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens))
    assert rel_err(layer(x), F.linear(x, w)) < 1e-6  # fp32 summation order only (~3e-7)


@native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 17])
def test_native_matmul_with_integer_activations(qtype, tokens):
    """The default kernels round the activations (int16: ~2e-5 relative, tests/quant/
    test_int_acts.py); these types' codes (0..3, -4..3, IQ4's levels up to -127) must not change
    that. Past 16 tokens they take int8 activations (kernels/cpu/int8_tiles.c, ~1e-2; a scale
    per 256 values for two-level tables, per 32 for float ones): checked against the activations
    rounded the same way, then int16 with int8 off."""
    raw = random_blocks(qtype, ROWS, COLS, seed=7)
    w = dequantize(raw, qtype, (ROWS, COLS))
    layer = QuantLinear(repack(raw, qtype, (ROWS, COLS), backend="native"))
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(1))
    quant_ops.set_int_acts(True)
    parts = layer.native_parts() if quant_ops.available() else None
    weights = parts[0] if parts else None
    int8 = bool(tokens > 16 and weights is not None and weights.kind != "f32"
                and build.lib().mw_int8_tiles_fit(int(weights.kind == "q4"), COLS, weights.group,
                                                  weights.scale_format))
    if int8 and weights.kind == "q8" and weights.scale_format < 2:  # float tables: narrow codes only
        int8 = int(weights.codes.max()) - int(weights.codes.min()) <= 63  # (IQ4_NL's span: int16)
    if int8:  # one int8 a value, a scale per superblock or block: the reference rounds x so too
        xs = x.view(tokens, -1, 256 if weights.scale_format >= 2 else 32)
        amax = xs.abs().amax(dim=2, keepdim=True)
        xq = torch.round(xs * (127.0 / amax)) * (amax / 127.0)
        assert rel_err(layer(x), F.linear(xq.view(tokens, COLS), w)) < 1e-5
    assert rel_err(layer(x), F.linear(x, w)) < (2e-2 if int8 else 1e-4)
    quant_ops.set_int8_tiles(False)
    try:
        assert rel_err(layer(x), F.linear(x, w)) < 1e-4
    finally:
        quant_ops.set_int8_tiles(True)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_torch_backend_requantizes_to_int8(qtype):
    raw = random_blocks(qtype, ROWS, COLS, seed=9)
    w = dequantize(raw, qtype, (ROWS, COLS))
    weights = repack(raw, qtype, (ROWS, COLS), backend="torch")
    assert weights.source == f"gguf {qtype.name} -> int8 per-channel"
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(2))
    assert rel_err(QuantLinear(weights)(x), F.linear(x, w)) < 2e-2  # bf16 + int8 rows (~8e-3)


# --------------------------------------------------------------------------- files

def test_file_tensors_of_each_type(tmp_path):
    """GGUFWriter writes the raw blocks; our reader gives back the bytes gguf-py decodes."""
    raws = {q: random_blocks(q, 4, 512, seed=11) for q in TYPES}
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for q, raw in raws.items():
        w.add_tensor(q.name.lower(), raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = {t.name: t for t in open_gguf(tmp_path / "t.gguf").tensors}
    for q, raw in raws.items():
        t = tensors[q.name.lower()]
        assert Q(t.tensor_type) == q and tuple(reversed(t.shape.tolist())) == (4, 512)
        ref = quants.dequantize(raw, q).reshape(4, 512)
        assert np.array_equal(dequantize(t.data, t.tensor_type, (4, 512)).numpy(), ref)


def test_iq4_nl_model_file_loads_and_repacks(tmp_path):
    """A tiny llama file (hidden 64: IQ4_NL's 32-value blocks fit, the K-quants' 256 do not) with
    q_proj (un-permuted on raw rows) and down_proj in IQ4_NL: the float loader decodes them to
    gguf-py's values and the quantized ones compute the same layer."""
    weights = hf_weights()
    blocks = {}
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        rows, cols = weights[key][0].shape
        blocks[key] = random_blocks(Q.IQ4_NL, rows, cols, seed=len(blocks))
        weights[key] = (blocks[key], Q.IQ4_NL, weights[key][2])
    reader = open_gguf(write_gguf(tmp_path / "m.gguf", weights))
    config = gguf_hf_config(reader)
    backend = "native" if quant_ops.available() else "torch"
    quant = gguf_quantized_linears(reader, config, backend=backend)
    floats = dict(iter_gguf_tensors(reader, config))
    for key, raw in blocks.items():
        module, w = key.removesuffix(".weight"), floats[key]
        assert np.array_equal(w.numpy(), quants.dequantize(raw, Q.IQ4_NL)), key
        x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(3))
        assert quant[module].source.startswith("gguf IQ4_NL")
        assert rel_err(QuantLinear(quant[module])(x), F.linear(x, w)) < (
            1e-4 if backend == "native" else 2e-2), module
