"""Quantized KV caches in the C kernels (memwall/kernels/cpu/paged_attention.c): the writer
byte-equal to the torch one (memwall/attention/kv_quant.py), and decode attention that reads
each format in place against the torch reference on the same (dequantized) values, in every
instruction-set build this CPU runs, at the shapes that break kernels (no sequences, one
token, lengths at block edges, blocks of one token, head dims off the 8-wide vectors)."""

from __future__ import annotations

import pytest
import torch

from memwall.attention import kv_quant
from memwall.kernels.cpu import build
from memwall.kernels.cpu.decode import NativeDecoder, kv_write, paged_decode_attention

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")
FORMATS = ["fp32", "fp16", "bf16", "int8", "fp8"]
# relative error of attention over a format's values against float32 ones (unit-normal data)
LOSSY = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1.5e-2, "int8": 2e-2, "fp8": 6e-2}


@pytest.fixture
def isa(isa_library):
    """The kernels of one instruction-set build stand in for this CPU's (conftest.py)."""
    return isa_library[0]


def _cache(shape, name: str) -> torch.Tensor:
    dtype = kv_quant.KV_DTYPES[name]
    return kv_quant.allocate(shape, dtype, lambda s, d: torch.zeros(s, dtype=d))


def _nasty_rows(kv_heads: int, dim: int) -> torch.Tensor:
    """Rows a rounding or saturation slip shows in: normal, huge, tiny (subnormal in fp16 and
    fp8), all-zero, exact halves."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(kv_heads, dim, generator=g),
            torch.randn(kv_heads, dim, generator=g) * 1e5,
            torch.randn(kv_heads, dim, generator=g) * 1e-6,
            torch.randn(kv_heads, dim, generator=g) * 3e-3,
            torch.zeros(kv_heads, dim),
            (torch.arange(kv_heads * dim).float().view(kv_heads, dim) - 7) * 0.5]
    return torch.stack(rows)  # [6, kv_heads, dim]


@pytest.mark.parametrize("name", FORMATS)
def test_c_writer_is_byte_equal_to_the_torch_writer(isa, name):
    x = _nasty_rows(3, 24)
    slots = torch.tensor([5, 0, 11, 2, 7, 9])
    c_cache, t_cache = _cache((3, 4, 3, 24), name), _cache((3, 4, 3, 24), name)
    kv_write(c_cache, x, slots)
    kv_quant.write(t_cache, x, slots)
    assert torch.equal(c_cache.view(torch.uint8), t_cache.view(torch.uint8))
    if name == "int8":
        assert torch.equal(kv_quant.scales_of(c_cache), kv_quant.scales_of(t_cache))
    read = kv_quant.dequantize(t_cache, kv_quant.scales_of(t_cache)).float().view(-1, 3, 24)[slots]
    assert torch.isfinite(read).all()  # saturating: no inf, no NaN
    with pytest.raises(ValueError, match="slot"):
        kv_write(c_cache, x[:1], torch.tensor([12]))


@pytest.mark.parametrize("dim", [16, 24, 64])
def test_int8_has_one_scale_per_16_values_of_a_token_and_head(isa, dim):
    """Each group of 16 values (the last one shorter when dim is not a multiple of 16) gets its
    own scale, so one large channel coarsens only its own group; the C writer agrees."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, 2, dim, generator=g) * torch.tensor([1.0, 40.0]).view(1, 2, 1)
    x[:, :, 0] = torch.tensor([1.0, 40.0]).view(1, 2) * 100  # an outlier channel, first group
    groups = -(-dim // 16)
    cache, c_cache = _cache((2, 4, 2, dim), "int8"), _cache((2, 4, 2, dim), "int8")
    kv_quant.write(cache, x, torch.arange(5))
    kv_write(c_cache, x, torch.arange(5))
    assert torch.equal(cache, c_cache)
    assert torch.equal(kv_quant.scales_of(cache), kv_quant.scales_of(c_cache))
    scales = kv_quant.scales_of(cache).view(-1, 2, groups)[:5]  # [tokens, heads, groups]
    padded = torch.nn.functional.pad(x, (0, groups * 16 - dim)).view(5, 2, groups, 16)
    torch.testing.assert_close(scales, padded.abs().amax(-1) / 127)
    codes = cache.view(-1, 2, dim)[:5]
    per_value = scales.repeat_interleave(16, -1)[..., :dim]
    err = (codes.float() * per_value - x).abs()
    assert (err <= per_value / 2 + 1e-6).all()  # round to nearest: half a step at most
    for group in range(groups):  # each group's largest value uses the full range
        assert codes[..., group * 16:(group + 1) * 16].abs().amax(-1).eq(127).all()
    if groups > 1:  # the outlier's group has the coarse step, the others keep theirs
        assert (scales[..., 1:] < scales[..., :1] / 5).all()
    assert torch.equal(kv_quant.dequantize(codes, scales), codes.float() * per_value)


def _case(lens: list[int], block: int, kv_heads: int, dim: int, name: str, seed: int):
    """q, a cache of ``name`` holding random K/V on scattered blocks, tables, lengths and the
    float32 K/V that were written."""
    g = torch.Generator().manual_seed(seed)
    width = max([-(-n // block) for n in lens], default=1)
    num_blocks = max(len(lens), 1) * width + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[b * width:(b + 1) * width] for b in range(len(lens))]
    shape = (num_blocks, block, kv_heads, dim)
    k32, v32 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k, v = _cache(shape, name), _cache(shape, name)
    slots = torch.arange(num_blocks * block)
    kv_quant.write(k, k32.view(-1, kv_heads, dim), slots)
    kv_quant.write(v, v32.view(-1, kv_heads, dim), slots)
    bt = torch.tensor(tables, dtype=torch.long).view(len(lens), width)
    return bt, torch.tensor(lens, dtype=torch.long), k, v, k32, v32


def _reference(q, k, v, lens, bt, scale):
    """Double-precision attention over float K/V [num_blocks, block, kv_heads, D]."""
    heads, kv_heads = q.shape[1], k.shape[2]
    out = []
    for b, n in enumerate(lens.tolist()):
        kk = k[bt[b]].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        vv = v[bt[b]].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), kk) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, vv))
    return torch.stack(out) if out else torch.empty(0, *q.shape[1:], dtype=torch.float64)


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item() if ref.numel() else 0.0


SHAPES = [  # lens, block, heads, kv_heads, dim
    ([15, 16, 17], 16, 9, 3, 64),       # block edges, SmolLM2's heads
    ([1], 16, 4, 2, 64),                # one token
    ([1, 2, 3, 40], 1, 4, 1, 32),       # blocks of one token
    ([200, 7, 129], 16, 8, 2, 24),      # past the 128-key split; head dim off the vectors
    ([300], 4, 5, 1, 16),               # a group of 5 (a 4-head pass and a 1-head pass)
    ([130, 5], 16, 6, 2, 80),           # AVX-512 value passes of 64 + 16 dims, past the split
    ([33], 8, 3, 1, 48),                # a 48-dim pass (three 16-wide vectors)
    ([20], 16, 4, 4, 128),              # two 64-dim passes, no GQA
]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("lens, block, heads, kv_heads, dim", SHAPES)
def test_attention_reads_each_format_in_place(isa, name, lens, block, heads, kv_heads, dim):
    bt, seq_lens, k, v, k32, v32 = _case(lens, block, kv_heads, dim, name, seed=len(lens) + dim)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
    out = paged_decode_attention(q, k, v, bt, seq_lens, 0.2)
    # the same values the cache holds, widened by torch: only float rounding apart
    kd = kv_quant.dequantize(k, kv_quant.scales_of(k)).float()
    vd = kv_quant.dequantize(v, kv_quant.scales_of(v)).float()
    assert _rel(out, _reference(q, kd, vd, seq_lens, bt, 0.2)) < 2e-6
    # and the format's own error against the float32 K/V
    assert _rel(out, _reference(q, k32, v32, seq_lens, bt, 0.2)) < LOSSY[name]


@pytest.mark.parametrize("name", FORMATS)
def test_attention_takes_no_sequences(isa, name):
    bt, lens, k, v, _, _ = _case([], 16, 2, 64, name, seed=0)
    out = paged_decode_attention(torch.zeros(0, 4, 64), k, v, bt.view(0, 1), lens, 0.1)
    assert out.shape == (0, 4, 64)


def test_attention_refuses_mixed_or_unscaled_caches():
    bt, lens, k, v, _, _ = _case([5], 4, 2, 16, "int8", seed=0)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q, k, v.float(), bt, lens, 0.1)
    with pytest.raises(ValueError, match="scales"):
        paged_decode_attention(q, k, torch.zeros_like(v), bt, lens, 0.1)  # no scales attached
    with pytest.raises(ValueError, match="cannot read"):
        paged_decode_attention(q, k.to(torch.float64), v.to(torch.float64), bt, lens, 0.1)


@pytest.fixture(scope="module")
def tiny_float():
    """A random 2-layer Llama-shaped float32 model (no transformers needed)."""
    from memwall.config import ModelArchConfig
    from memwall.models.registry import build_model

    torch.manual_seed(0)
    arch = ModelArchConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256))
    model = build_model(arch).eval()
    model.fuse_projections()
    return arch, model


@torch.inference_mode()
@pytest.mark.parametrize("name", FORMATS)
def test_fused_decode_step_writes_and_reads_each_format(isa, tiny_float, name):
    """The fused step against the model's torch forward on the same quantized cache: the
    hidden states agree to float rounding, and the new tokens' K/V land in the same slots in
    the same format (their float inputs differ by rounding, so a code may flip a step)."""
    from memwall.attention.metadata import AttentionMetadata
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    arch, model = tiny_float
    block, lens = 16, [15, 16, 17, 1]
    dtype = kv_quant.KV_DTYPES[name]
    caches = allocate_kv_cache(arch, KVCachePlan(8, block, 0), dtype)
    g = torch.Generator().manual_seed(1)
    for k, v in caches:  # earlier tokens, as a prefill in this format left them
        for cache in (k, v):
            kv_quant.write(cache, torch.randn(8 * block, 2, 16, generator=g), torch.arange(8 * block))
    ref_caches = [tuple(kv_quant.allocate(c.shape, dtype, lambda s, d: torch.zeros(s, dtype=d))
                        for c in pair) for pair in caches]
    for pair, ref in zip(caches, ref_caches):
        for c, r in zip(pair, ref):
            r.copy_(c)
            if kv_quant.scales_of(c) is not None:
                kv_quant.scales_of(r).copy_(kv_quant.scales_of(c))
    tables = [[0, 1], [2, 3], [4, 5], [6]]
    bt = torch.tensor([t + [0] * (2 - len(t)) for t in tables])
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)])
    ids = torch.randint(0, arch.vocab_size, (len(lens),), generator=g)
    decoder = NativeDecoder.build(model, caches)
    assert decoder is not None, f"the fused step refused a {name} cache"
    got = decoder.step(model.model.embed_tokens(ids), positions, slots, torch.tensor(lens), bt)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block)
    ref = model(ids, positions, ref_caches, meta)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    for pair, ref in zip(caches, ref_caches):
        for c, r in zip(pair, ref):
            same = c.view(torch.uint8) == r.view(torch.uint8)
            assert same.float().mean() > 0.99
            got_kv = kv_quant.dequantize(c, kv_quant.scales_of(c)).float()
            ref_kv = kv_quant.dequantize(r, kv_quant.scales_of(r)).float()
            assert ((got_kv - ref_kv).norm() / ref_kv.norm()).item() < 1e-3
