"""Our torch dequantization kernels against gguf-py's numpy reference (gguf.quants).

Legacy quants are built with gguf.quants.quantize from random floats; every quantized type
is also fed random bytes (with finite fp16 scale fields), which reaches bit patterns a
quantizer would never produce. Results must be bit-identical to the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

from memwall.loader.errors import ModelLoadError
from memwall.loader.gguf_weights import SUPPORTED_GGUF_TYPES, dequantize

QUANTIZED = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# byte offsets of each block's fp16 scale fields (d, and dmin/m where the type has one)
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
              Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes shaped like GGUFReader's tensor.data, scale fields set to small finite f16."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=rows * blocks_per_row).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def assert_matches_reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    ours = dequantize(raw, qtype, shape)
    ref = quants.dequantize(raw, qtype).reshape(shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ours.numpy(), ref)
    return ours


def test_supported_types_are_the_documented_ones():
    assert set(SUPPORTED_GGUF_TYPES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                                         "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_legacy_quants_from_quantized_floats(qtype):
    rng = np.random.default_rng(7)
    floats = (rng.standard_normal((8, 96)) * 0.3).astype(np.float32)
    raw = quants.quantize(floats, qtype)
    ours = assert_matches_reference(raw, qtype, floats.shape)
    # and the quantization really round-trips: error within one quantization step
    step = np.abs(floats).max() / {Q.Q8_0: 127, Q.Q5_0: 15, Q.Q5_1: 15}.get(qtype, 7)
    assert np.abs(ours.numpy() - floats).max() <= step


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_blocks_match_reference(qtype, seed):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows=5, blocks_per_row=3, seed=seed)
    assert_matches_reference(raw, qtype, (5, 3 * block_size))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_three_dim_shape_and_flat_bytes(qtype):
    """Blocks run along the last axis whatever the rank; a flat byte buffer works too."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows=6, blocks_per_row=2, seed=3)
    shape = (2, 3, 2 * block_size)
    ours = dequantize(raw.reshape(-1), qtype, shape)
    np.testing.assert_array_equal(ours.numpy(), quants.dequantize(raw, qtype).reshape(shape))


def test_q4_0_hand_built_block():
    """Independent of the reference: low nibbles are values 0..15, high nibbles 16..31."""
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0.5], dtype=np.float16).view(np.uint8), qs])
    out = dequantize(block, Q.Q4_0, (32,))
    expected = [(j - 8) * 0.5 for j in range(16)] + [(15 - j - 8) * 0.5 for j in range(16)]
    assert out.tolist() == expected


def test_q8_0_hand_built_block():
    qs = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.25], dtype=np.float16).view(np.uint8), qs.view(np.uint8)])
    assert dequantize(block, Q.Q8_0, (32,)).tolist() == [q * 0.25 for q in range(-16, 16)]


def test_float_types():
    rng = np.random.default_rng(11)
    f32 = rng.standard_normal((4, 10)).astype(np.float32)
    assert torch.equal(dequantize(f32, Q.F32, (4, 10)), torch.from_numpy(f32))
    assert torch.equal(dequantize(f32.view(np.uint8), Q.F32, (4, 10)), torch.from_numpy(f32))
    f16 = f32.astype(np.float16)
    assert torch.equal(dequantize(f16, Q.F16, (4, 10)), torch.from_numpy(f16.astype(np.float32)))
    assert torch.equal(dequantize(f16.view(np.uint8), Q.F16, (4, 10)),
                       torch.from_numpy(f16.astype(np.float32)))


def test_bf16_in_every_raw_form():
    """GGUFReader hands BF16 over as bytes; uint16/int16 views must decode the same."""
    rng = np.random.default_rng(12)
    floats = rng.standard_normal((3, 16)).astype(np.float32)
    raw = quants.quantize(floats, Q.BF16)  # uint8, (3, 32)
    ref = quants.dequantize(raw, Q.BF16)
    for form in (raw, raw.view(np.uint16), raw.view(np.int16)):
        np.testing.assert_array_equal(dequantize(form, Q.BF16, (3, 16)).numpy(), ref)
    assert np.abs(ref - floats).max() <= np.abs(floats).max() / 128


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.TQ1_0], ids=lambda q: q.name)
def test_unsupported_type_is_named(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    with pytest.raises(ModelLoadError, match=qtype.name) as err:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype, (block_size,))
    assert "Q4_K" in str(err.value)  # the message lists what is supported


def test_wrong_byte_count_is_an_error():
    with pytest.raises(ModelLoadError, match="bytes"):
        dequantize(np.zeros(33, dtype=np.uint8), Q.Q8_0, (32,))
    with pytest.raises(ModelLoadError, match="block size"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (2, 16))
