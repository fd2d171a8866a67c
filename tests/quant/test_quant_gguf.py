"""GGUF blocks repacked for our kernels against memwall.loader.gguf_weights.dequantize.

Random blocks (finite f16 scale fields) reach every code value. Native backend: the kernel
output is F.linear with the reference-dequantized weight up to fp32 summation order
(relative 1e-5). Torch backend (bf16 activations, scales and output): relative 1e-2, except
Q6_K, which is requantized to per-channel int8 (2e-2 on these worst-case random blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf
from memwall.loader.gguf_weights import dequantize
from memwall.kernels.cpu import quant_ops
from memwall.quant.base import QuantLinear
from memwall.quant.gguf_repack import gguf_quantized_linears, repack
from memwall.quant.int4_cpu import _layout, dequantize_int4

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q6_K]
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
              Q.Q5_K: [0, 2], Q.Q6_K: [208]}
BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not quant_ops.available(), reason="no C compiler for the native kernels"))]


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 70])
def test_repacked_linear_matches_reference_dequant(qtype, backend, tokens):
    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    w = dequantize(raw, qtype, (rows, cols))
    layer = QuantLinear(repack(raw, qtype, (rows, cols), backend))
    x = torch.randn(tokens, cols)
    tol = 1e-5 if backend == "native" else (2e-2 if qtype == Q.Q6_K else 1e-2)
    assert rel_err(layer(x), F.linear(x, w)) < tol


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q8_0], ids=lambda q: q.name)
def test_torch_planes_are_exact_up_to_bf16_scales(qtype):
    """Each weight is off by at most the bf16 rounding of its group's scale and zero."""
    if _layout() is None:
        pytest.skip("cannot unpack torch's int4 layout on this CPU")
    rows, cols = 32, 256
    raw = random_blocks(qtype, rows, cols, seed=9)
    w = dequantize(raw, qtype, (rows, cols))
    layer = QuantLinear(repack(raw, qtype, (rows, cols), "torch"))
    sz = layer.scales_zeros.float().abs()  # [P, K/32, N, 2]: a bf16 value is within 2^-8 of its f32
    bound = (2.0 ** -8 * (16 * sz[..., 0] + sz[..., 1])).sum(0).t().repeat_interleave(32, 1)
    assert ((dequantize_int4(layer) - w).abs() <= bound + 1e-6).all()


def test_float_types_are_left_alone():
    assert repack(np.zeros((4, 64), np.float32), Q.F32, (4, 64)) is None


def test_embedded_file_repacks_to_the_loaders_weights(gguf_path):
    """Names, the tied head, and llama's q/k un-permutation on raw rows, for a few layers
    (one backend: the row handling is the same for both, and the torch one packs slowly)."""
    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    backend = "native" if quant_ops.available() else "torch"
    quant = gguf_quantized_linears(reader, config, backend=backend)
    native_embedding = backend == "native"  # a QuantEmbedding reads the native layouts only
    assert len(quant) == 7 * config["num_hidden_layers"] + 1 + native_embedding
    assert quant["lm_head"].source == "gguf Q8_0"
    if native_embedding:  # tied: one table for the head and the embedding
        assert quant["model.embed_tokens"] is quant["lm_head"]
    wanted = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
              "model.layers.3.mlp.down_proj", "model.embed_tokens"}
    x = torch.randn(2, config["hidden_size"])
    for name, w in iter_gguf_tensors(reader, config):  # file order: stop once all are seen
        module = name.removesuffix(".weight")
        if module not in wanted:
            continue
        wanted.discard(module)
        layer = QuantLinear(quant["lm_head" if module == "model.embed_tokens" else module])
        xi = x if w.shape[1] == x.shape[1] else torch.randn(2, w.shape[1])
        assert rel_err(layer(xi), F.linear(xi, w)) < (1e-5 if backend == "native" else 1e-2), name
        if not wanted:
            break
    assert not wanted


# bytes a weight as kept in memory (codes + scale and offset tables) by the native layouts
NATIVE_BYTES = {Q.Q4_0: 0.625, Q.Q4_1: 0.625, Q.Q5_0: 1.125, Q.Q5_1: 1.125, Q.Q8_0: 1.125,
                Q.Q4_K: 0.5 + 2 * 12 / 256, Q.Q5_K: 1 + 2 * 12 / 256, Q.Q6_K: 1 + 2 * 20 / 256}


@pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_native_layouts_keep_the_reference_weights_in_few_bytes(qtype):
    """fp16 tables for Q4_0/Q4_1/Q5_x/Q8_0, ggml's two-level tables for the K-quants (a float32
    d per 256 values, an int8 sub-scale per group): the kernels' dequantizer rebuilds the GGUF
    reference weights bit for bit, at the bytes a weight that layout costs."""
    rows, cols = 8, 512
    raw = random_blocks(qtype, rows, cols, seed=3)
    t = repack(raw, qtype, (rows, cols), "native").tensors
    rebuilt = (quant_ops.q4_dequantize(t["codes"], t["s"], t["c"], cols) if t["codes"].dtype == torch.uint8
               else quant_ops.q8_dequantize(t["codes"], t["s"], t["c"]))
    assert torch.equal(rebuilt, dequantize(raw, qtype, (rows, cols)))
    assert sum(v.numel() * v.element_size() for v in t.values()) == NATIVE_BYTES[qtype] * rows * cols


@pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the native kernels")
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_codes_from_c_equal_the_torch_shuffles(qtype, monkeypatch):
    """gguf_codes.c's codes and K-quant scales (the native load path) are the torch byte
    operations' bytes, on random blocks (every code value, both nibbles, every qh bit, every
    6-bit scale and min), in several threads' shares
    (10,000 blocks pass every parallel threshold), scales and offsets untouched."""
    from memwall.quant import gguf_repack

    raw = random_blocks(qtype, 40, 64000 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 8000, seed=11)
    shape = (40, raw.size // 40 * GGML_QUANT_SIZES[qtype][0] // GGML_QUANT_SIZES[qtype][1])
    from_c = []
    real = gguf_repack._c_codes
    monkeypatch.setattr(gguf_repack, "_c_codes", lambda *a: from_c.append(real(*a)) or from_c[-1])
    fast = repack(raw, qtype, shape, backend="native")
    # the codes came from C (and the K-quants' 6-bit scales: Q4_K calls twice, Q5_K once)
    assert len(from_c) == {Q.Q4_K: 2, Q.Q5_K: 1}.get(qtype, 1) and None not in from_c
    monkeypatch.setattr(gguf_repack, "_C_CODES_ON", False)
    slow = repack(raw, qtype, shape, backend="native")
    assert set(fast.tensors) == set(slow.tensors)
    for name, t in slow.tensors.items():
        assert torch.equal(fast.tensors[name], t), name
