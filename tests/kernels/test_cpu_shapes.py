"""Every native CPU kernel entry point against a torch reference at the shapes that break
kernels: no tokens, one token, K and N off the block, group and 4-row tile sizes, token counts
around the 16-token tile and the 2,048-token step budget, batches of 1..17. Each runs in every
instruction-set build this CPU can execute (native, AVX2 + FMA, baseline x86-64 without AVX),
because each build compiles its own code paths. Shapes a kernel cannot take raise ValueError in
Python and never reach C. Last, the engine across the step budget (issue 13: a prefill chunk
that needs no logits asked the q8 LM head for zero rows, and the kernel divided by that count).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from memwall.kernels.cpu import build, quant_ops
from memwall.kernels.cpu.decode import NativeDecoder, paged_decode_attention

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")
TOKENS = [0, 1, 2, 15, 16, 17, 33, 2048, 2049]  # around the 16-token tile and the step budget


@pytest.fixture
def isa(isa_library):
    """The kernels of one instruction-set build stand in for this CPU's (conftest.py), on their
    exact fp32 paths; the integer ones are tested below."""
    name, cdll = isa_library
    cdll.mw_set_int_acts(0)
    yield name
    cdll.mw_set_int_acts(1)


def _weight(kind: str, n: int, k: int, group: int, seed: int):
    """Random codes, s, c in the layout.py layout and the float weight they stand for."""
    g = torch.Generator().manual_seed(seed)
    if kind == "q4":
        q = torch.randint(0, 16, (n, k), generator=g)
        codes = q.view(n, k // 32, 2, 16).to(torch.uint8)
        codes = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    else:
        q = torch.randint(-128, 128, (n, k), generator=g)
        codes = q.to(torch.int8)
    s, c = torch.rand(n, k // group, generator=g), torch.randn(n, k // group, generator=g)
    w = (q.float().view(n, -1, group) * s[..., None] + c[..., None]).view(n, k)
    return codes, s, c, w


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    assert y.shape == ref.shape and y.dtype == torch.float32
    if ref.numel():
        assert torch.isfinite(y).all()
        assert ((y.double() - ref).norm() / ref.norm()).item() < tol


# kind, K, group: K past the L1 K-block (640 inputs for 16 tokens) and off the int8 kernels' 64
WEIGHTS = [("q4", 32, 32), ("q4", 96, 32), ("q4", 1376, 32),  # odd block counts: one at a time
           ("q4", 64, 32), ("q4", 1344, 32),  # even: two blocks a load (int_gemm.c's pair layout)
           ("q8", 16, 16), ("q8", 96, 32), ("q8", 144, 48), ("q8", 1312, 1312),
           ("q8", 64, 32), ("q8", 1344, 32), ("q8", 1344, 16)]  # even: int_gemm.c's q8 pairs


@pytest.mark.parametrize("kind, k, group", WEIGHTS)
def test_quantized_matmuls_at_every_batch_size(isa, kind, k, group):
    matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
    g = torch.Generator().manual_seed(k)
    for n in (1, 3, 4, 37):  # 1, 3, 37: not a multiple of the 4-row one-token kernel
        codes, s, c, w = _weight(kind, n, k, group, seed=n)
        for m in TOKENS if n in (4, 37) else (0, 1, 17):
            x = torch.randn(m, k, generator=g)
            _close(matmul(x, codes, s, c), x.double() @ w.double().T)
        dequantized = (quant_ops.q4_dequantize(codes, s, c, k) if kind == "q4"
                       else quant_ops.q8_dequantize(codes, s, c))
        assert torch.equal(dequantized, w)  # bit-identical to the reference formula


INT_TOKENS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 127, 128, 129]  # around the row groups,
# the 8-token tile, MW_MAX_ROWS and INT_ACTS_MAX_TOKENS (the integer kernels' limit)


@pytest.mark.parametrize("kind, k, group", WEIGHTS)
def test_integer_activation_kernels_at_every_shape(isa, kind, k, group):
    """The integer-activation kernels (AVX2 vpmaddwd, VNNI vpdpwssd, plain C: one per build) at every
    batch size; shapes they do not take (K off the 32-value activation block, a q8 group of 48)
    go back to the fp32 kernels. (int8_tiles.c's int8 prefill, which takes q8 float tables of
    32-value groups past 16 tokens, is switched off here: tests/kernels/test_int8_tiles.py.)"""
    lib = build.lib()
    lib.mw_set_int_acts(1)
    lib.mw_set_int8_tiles(0)
    try:
        _integer_activation_kernels(lib, kind, k, group)
    finally:
        lib.mw_set_int8_tiles(1)


def _integer_activation_kernels(lib, kind: str, k: int, group: int) -> None:
    matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
    g = torch.Generator().manual_seed(k + 1)
    for n in (1, 3, 37):
        codes, s, c, w = _weight(kind, n, k, group, seed=n)
        for m in INT_TOKENS if n == 37 else (1, 9):
            x = torch.randn(m, k, generator=g)
            y, ref = matmul(x, codes, s, c), x.double() @ w.double().T
            assert y.shape == (m, n) and torch.isfinite(y).all()
            # the activations' rounding (~2e-5 of each |x|) against the magnitudes it scales
            scale = x.double().abs() @ w.double().abs().T
            assert ((y.double() - ref).abs() <= 1e-4 * scale + 1e-6).all()
    # the integer kernel itself ran (not a fallback): its result differs from the exact one by
    # the activations' rounding, and it says it took the shape
    codes, s, c, w = _weight(kind, 37, k, group, seed=3)
    x = torch.randn(9, k, generator=g)
    y = torch.empty(9, 37)
    fn, grouped = ((lib.mw_q4_gemm_i16, ()) if kind == "q4" else (lib.mw_q8_gemm_i16, (group,)))
    took = fn(x.data_ptr(), 9, k, *grouped, codes.data_ptr(), s.data_ptr(), c.data_ptr(),
              y.data_ptr(), 37, 0)
    assert took == int(k % 32 == 0 and (group == 16 or group % 32 == 0))  # 32-value blocks
    if took:
        error = (y.double() - x.double() @ w.double().T).abs()
        assert 0 < error.max() and (error <= 1e-4 * (x.double().abs() @ w.double().abs().T)).all()


def test_every_build_runs_its_own_integer_path(isa):
    """native here picks the best the CPU has; avx2 vpmaddwd; baseline plain C."""
    expected = {"avx2": 2, "baseline": 1}.get(isa)
    got = build.lib().mw_int_gemm_isa()
    assert got == expected if expected else got >= 2 or not build.runs_here("avx2")


def test_c_entry_points_take_zero_rows_and_more_than_a_tile(isa):
    """The kernels themselves, without the Python guards: M = 0 (the issue's SIGFPE), M past
    MW_MAX_ROWS (taken 16 at a time), N = 0."""
    lib = build.lib()
    codes, s, c, w = _weight("q8", 8, 64, 32, seed=1)
    for m, n in ((0, 8), (17, 8), (40, 8), (3, 0)):
        x = torch.randn(m, 64)
        y = torch.full((m, n), float("nan"))
        lib.q8_gemm(x.data_ptr(), m, 64, 32, codes.data_ptr(), s.data_ptr(), c.data_ptr(),
                    y.data_ptr(), n, 0)
        lib.q8_gemm_tiles(x.data_ptr(), m, 64, 32, codes.data_ptr(), s.data_ptr(), c.data_ptr(),
                          y.data_ptr(), n, 0)
        _close(y, x.double() @ w[:n].double().T)
    codes, s, c, w = _weight("q4", 8, 64, 32, seed=2)
    for m in (0, 17, 40):
        x = torch.randn(m, 64)
        y = torch.full((m, 8), float("nan"))
        lib.q4_gemm(x.data_ptr(), m, 64, codes.data_ptr(), s.data_ptr(), c.data_ptr(), y.data_ptr(), 8, 0)
        _close(y, x.double() @ w.double().T)


def test_shapes_the_matmuls_cannot_take_are_refused_in_python():
    codes, s, c, _ = _weight("q8", 8, 96, 32, seed=3)
    q4_codes, q4_s, q4_c, _ = _weight("q4", 8, 96, 32, seed=4)
    bad = [
        lambda: quant_ops.q8_matmul(torch.randn(2, 64), codes, s, c),  # x's K is not the weight's
        lambda: quant_ops.q8_matmul(torch.randn(2, 96).double(), codes, s, c),
        lambda: quant_ops.q8_matmul(torch.randn(96, 2).t(), codes, s, c),  # not contiguous
        lambda: quant_ops.q8_matmul(torch.randn(2, 96), codes, s[:5], c[:5]),  # rows differ
        lambda: quant_ops.q8_matmul(torch.randn(2, 96), codes, torch.rand(8, 4), torch.rand(8, 4)),  # group 24
        lambda: quant_ops.q8_matmul(torch.randn(2, 96), codes.to(torch.uint8), s, c),
        lambda: quant_ops.q4_matmul(torch.randn(2, 80), q4_codes[:, :40].contiguous(), q4_s, q4_c),  # K % 32
        lambda: quant_ops.q4_matmul(torch.randn(2, 96), q4_codes, q4_s.double(), q4_c),
        lambda: quant_ops.q4_matmul(torch.randn(2, 96), q4_codes[:4], q4_s, q4_c),  # rows differ
        lambda: quant_ops.q4_matmul(torch.randn(96), q4_codes, q4_s, q4_c),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


# --------------------------------------------------------------------------- paged attention

def _attention_case(batch: int, block: int, heads: int, kv_heads: int, dim: int, seed: int):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, block, block + 1, 130, 300]) for _ in range(batch)]
    num_blocks = sum(-(-n // block) for n in lens) + 2
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in lens:  # scattered over the pool, as sequences interleave
        tables.append(pool[:-(-n // block)])
        pool = pool[len(tables[-1]):]
    width = max([len(t) for t in tables], default=1)
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(batch, width)
    return q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.long), tables


def _attention_ref(q, k_cache, v_cache, lens, tables, scale):
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = []
    for b, (n, table) in enumerate(zip(lens.tolist(), tables)):
        k = k_cache[table].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out) if out else torch.empty(0, *q.shape[1:], dtype=torch.float64)


@pytest.mark.parametrize("block, heads, kv_heads, dim", [(16, 4, 2, 64), (5, 3, 3, 24), (4, 8, 1, 16)])
def test_paged_attention_at_every_batch_size(isa, block, heads, kv_heads, dim):
    """Batches 1..17 of lengths from 1 to past the 128-key split; odd block sizes and a head
    dim off the 16-wide vectors."""
    for batch in range(0, 18):
        q, k_cache, v_cache, bt, lens, tables = _attention_case(batch, block, heads, kv_heads, dim, batch)
        out = paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.3)
        _close(out, _attention_ref(q, k_cache, v_cache, lens, tables, 0.3))


def _cache(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x float [blocks, block, kv_heads, D] in one of the native KV formats."""
    from memwall.attention import kv_quant

    if fmt == "fp32":
        return x
    if fmt == "fp16":
        return x.half()
    cache = kv_quant.int8_cache(tuple(x.shape))
    kv_quant.write(cache, x.flatten(0, 1), torch.arange(x.shape[0] * x.shape[1]))
    return cache


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("block, heads, kv_heads, dim", [(16, 9, 3, 64), (5, 3, 3, 24), (4, 8, 1, 16)])
def test_verification_rows_attend_together_and_each_as_alone(isa, fmt, block, heads, kv_heads, dim):
    """Speculative verification: k + 1 rows of one sequence (one block table, lengths L..L+k)
    among other rows. The kernel attends each run's rows together; every row is the same
    bits as that row alone, for runs inside one key range, on and across the 128-key split,
    and runs longer than the 17 rows one item takes."""
    g = torch.Generator().manual_seed(block * heads + dim)
    rng = random.Random(dim)
    runs = [(1, 1), (1, 5), (3, 4), (14, 2), (124, 6), (127, 3), (128, 1), (126, 9), (200, 5),
            (254, 4), (256, 17), (300, 20), (40, 1)]
    num_blocks = sum(-(-(start + count) // block) for start, count in runs) + 1
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, lens = [], []
    for start, count in runs:
        table = pool[:-(-(start + count - 1) // block)]
        pool = pool[len(table):]
        for j in range(count):  # every row carries the sequence's whole table, as the runner's
            tables.append(table)
            lens.append(start + j)
    width = max(len(t) for t in tables)
    k_cache = _cache(torch.randn(num_blocks, block, kv_heads, dim, generator=g), fmt)
    v_cache = _cache(torch.randn(num_blocks, block, kv_heads, dim, generator=g), fmt)
    q = torch.randn(len(lens), heads, dim, generator=g)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    seq_lens = torch.tensor(lens, dtype=torch.long)
    out = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, 0.3)
    for b in range(len(lens)):
        alone = paged_decode_attention(q[b:b + 1], k_cache, v_cache, bt[b:b + 1], seq_lens[b:b + 1], 0.3)
        assert torch.equal(out[b:b + 1], alone), (b, lens[b])
    if fmt == "fp32":
        _close(out, _attention_ref(q, k_cache, v_cache, seq_lens, tables, 0.3))


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("heads, dim", [(8, 64), (12, 16), (6, 128)])
def test_wide_gqa_groups_score_keys_as_narrow_ones(isa, fmt, heads, dim):
    """More than 4 query heads on a KV head take the 16-key score code (AVX-512 builds); the
    same heads in groups of at most 4 take the 8-key one. Both add a key's products in one
    order, so every head's output is the same bits either way, at every length up to past the
    128-key split (padded last chunks included)."""
    g = torch.Generator().manual_seed(heads * dim)
    block, lens = 16, [1, 15, 16, 17, 33, 128, 129, 200]
    num_blocks = sum(-(-n // block) for n in lens) + 1
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        tables.append(pool[:-(-n // block)])
        pool = pool[len(tables[-1]):]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    seq_lens = torch.tensor(lens, dtype=torch.long)
    k_cache = _cache(torch.randn(num_blocks, block, 1, dim, generator=g), fmt)
    v_cache = _cache(torch.randn(num_blocks, block, 1, dim, generator=g), fmt)
    q = torch.randn(len(lens), heads, dim, generator=g)
    wide = paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, 0.3)
    for h0 in range(0, heads, 4):
        narrow = paged_decode_attention(q[:, h0:h0 + 4].contiguous(), k_cache, v_cache, bt, seq_lens, 0.3)
        assert torch.equal(wide[:, h0:h0 + 4], narrow), h0
    if fmt == "fp32":
        _close(wide, _attention_ref(q, k_cache, v_cache, seq_lens, tables, 0.3))


def test_attention_inputs_outside_the_cache_are_refused():
    q, k_cache, v_cache, bt, lens, _ = _attention_case(3, 4, 4, 2, 16, seed=9)
    bad = [
        (bt, torch.tensor([0, 1, 1])),  # a length of 0
        (bt, torch.tensor([1, 1, bt.shape[1] * 4 + 1])),  # past the table
        (torch.full_like(bt, k_cache.shape[0]), lens),  # a block id past the pool
        (torch.full_like(bt, -1), lens),
        (bt.int(), lens),  # int32 tables
        (bt, lens[:2]),  # lengths for 2 of 3 sequences
    ]
    for tables, seq_lens in bad:
        with pytest.raises(ValueError):
            paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(torch.randn(3, 3, 16), k_cache, v_cache, bt, lens, 0.3)
    with pytest.raises(ValueError, match="v_cache"):
        paged_decode_attention(q, k_cache, v_cache[:, :2].contiguous(), bt, lens, 0.3)


# --------------------------------------------------------------------------- the decode step

@pytest.fixture(scope="module")
def tiny_quantized():
    """A random 2-layer Qwen2-shaped model (q/k/v biases) with native int8 weights, whose first
    q/k/v fuse into a ConcatLinear (q8 q, q4 k and v: no one kernel holds both), so every kind
    of projection the decode step reads is there. Built without transformers (fast)."""
    from memwall.config import ModelArchConfig
    from memwall.models.registry import build_model
    from memwall.quant import QuantLinear, quantize_model
    from memwall.quant.int4_cpu import NativeQ4
    from memwall.quant.transform import ConcatLinear

    torch.manual_seed(0)
    arch = ModelArchConfig.from_hf_dict(dict(
        model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256))
    model = build_model(arch).eval()
    attn = model.model.layers[0].self_attn
    for name in ("k_proj", "v_proj"):
        linear = getattr(attn, name)
        setattr(attn, name, QuantLinear(NativeQ4().create_weights(linear.weight.detach()), linear.bias))
    quantize_model(model, "int8")
    model.fuse_projections()
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, ConcatLinear)
    return arch, model


def _decode_inputs(batch: int, lens: list[int], block: int):
    tables = [[b * 8 + i for i in range(-(-n // block))] for b, n in enumerate(lens)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)])
    return torch.tensor([n - 1 for n in lens]), slots, torch.tensor(lens), bt


@torch.inference_mode()
def test_decode_step_at_every_batch_size(isa, tiny_quantized):
    """One fused step for 0..17 sequences (past the 16-row kernels) against the model's torch
    forward on the same cache."""
    from memwall.attention.metadata import AttentionMetadata
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    arch, model = tiny_quantized
    block, g = 4, torch.Generator().manual_seed(0)
    for batch in (0, 1, 2, 16, 17):
        caches = allocate_kv_cache(arch, KVCachePlan(8 * max(batch, 1), block, 0), torch.float32)
        decoder = NativeDecoder.build(model, caches)
        assert decoder is not None
        if batch == 0:
            none, table = torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)
            x = torch.zeros(0, arch.hidden_size)
            assert decoder.step(x, none, none, none, table).shape == x.shape
            continue
        for k, v in caches:  # earlier tokens' K/V, as a prefill would have left them
            k.normal_(generator=g)
            v.normal_(generator=g)
        lens = [1 + (7 * b) % 29 for b in range(batch)]
        ids = torch.randint(0, arch.vocab_size, (batch,), generator=g)
        ref_caches = [(k.clone(), v.clone()) for k, v in caches]
        positions, slots, seq_lens, bt = _decode_inputs(batch, lens, block)
        got = decoder.step(model.model.embed_tokens(ids), positions, slots, seq_lens, bt)
        tables = [row[:-(-n // block)] for row, n in zip(bt.tolist(), lens)]
        meta = AttentionMetadata.build([1] * batch, lens, tables, block)
        ref = model(ids, positions, ref_caches, meta)  # the torch reference backend
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        for (k, v), (rk, rv) in zip(caches, ref_caches):  # the same K/V in the same slots
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_decode_step_refuses_inputs_outside_the_model(tiny_quantized):
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

    arch, model = tiny_quantized
    caches = allocate_kv_cache(arch, KVCachePlan(16, 4, 0), torch.float32)
    decoder = NativeDecoder.build(model, caches)
    x = torch.zeros(2, arch.hidden_size)
    positions, slots, seq_lens, bt = _decode_inputs(2, [3, 5], 4)
    far = torch.tensor([0, 10 ** 6])
    for args, match in (((far, slots, seq_lens, bt), "position"),
                        ((positions, far, seq_lens, bt), "slot"),
                        ((positions, slots, torch.tensor([0, 5]), bt), "length"),
                        ((positions, slots, seq_lens, bt + 100), "block"),
                        ((positions.int(), slots, seq_lens, bt), "int64")):
        with pytest.raises(ValueError, match=match):
            decoder.step(x.clone(), *args)


# --------------------------------------------------------------------------- the engine

PROMPT_64 = list(range(100, 100 + 3 * 64 + 1))  # three 64-token chunks and one more token
PROMPT_2049 = list(range(100, 2149))  # the prompt: one token past the default budget


@contextlib.contextmanager
def _torch_only():
    """MEMWALL_NATIVE=0 for this process: no C kernels (``build.lib`` is cached, so patched)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMWALL_NATIVE", "0")
        mp.setattr(build, "lib", lambda: None)
        yield


def _greedy(llm, prompt: list[int]) -> list[int]:
    from memwall import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def torch_path(gguf_path):
    """prompt -> greedy tokens of the float model on torch alone, the prompt in one prefill:
    the oracle the native runs must match. (One thread: the test machines are shared.)"""
    from memwall import LLM

    with _torch_only():
        llm = LLM(str(gguf_path), quantization="none", num_kv_blocks=2176 // 16,
                  max_num_batched_tokens=4096, prefix_caching=False, threads=1)

    def tokens(prompt: list[int]) -> list[int]:
        with _torch_only():
            return _greedy(llm, prompt)
    return tokens


def _native_llm(gguf_path, budget: int):
    from memwall import LLM

    return LLM(str(gguf_path), max_num_batched_tokens=budget, num_kv_blocks=2176 // 16,
               prefix_caching=False, threads=1)


def test_engine_chunks_past_a_small_budget(gguf_path, torch_path):
    """Native kernels on (q4 layers, q8 head), a prompt of 3 budgets + 1: its three non-final
    chunks need no logits (zero LM-head rows), and the tokens equal the torch path's."""
    assert _greedy(_native_llm(gguf_path, 64), PROMPT_64) == torch_path(PROMPT_64)


@pytest.mark.slow  # two 2,049-token prefills: ~10 s on 2 idle cores
def test_engine_past_the_default_budget(gguf_path, torch_path):
    """The issue's reproducer with the default 2,048-token budget: a 2,048-token chunk that
    needs no logits, then the last token; tokens equal the torch path's."""
    assert _greedy(_native_llm(gguf_path, 2048), PROMPT_2049) == torch_path(PROMPT_2049)


HALF_TOKENS = [1, 2, 9, 16, 17, 32, 40, 129]  # gemv, integer rows, tiles, past the integer limit


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 16), ("q8", 32), ("q8", 64)])
@pytest.mark.parametrize("int_acts", [True, False])
def test_fp16_scale_tables_give_the_float32_tables_results(isa, kind, group, int_acts):
    """GGUF's fp16 scales stay fp16 in memory (layout.py): every kernel widens them to the very
    floats a float32 table holds, so each path's result is bit-identical to the same weight with
    float32 tables (one-token gemv, integer rows, AVX-512 tiles, exact kernels, dequantizers)."""
    lib = build.lib()
    codes, s, c, _ = _weight(kind, 40, 128, group, seed=7)
    s, c = s.half().float(), (c * 4).half().float()  # values fp16 holds exactly
    s16, c16 = s.half(), c.half()
    matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
    lib.mw_set_int_acts(int(int_acts))
    try:
        for m in HALF_TOKENS:
            x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
            assert torch.equal(matmul(x, codes, s16, c16), matmul(x, codes, s, c)), m
    finally:
        lib.mw_set_int_acts(0)
    dequantize = ((lambda a, b: quant_ops.q4_dequantize(codes, a, b, 128)) if kind == "q4"
                  else (lambda a, b: quant_ops.q8_dequantize(codes, a, b)))
    assert torch.equal(dequantize(s16, c16), dequantize(s, c))


def test_scale_tables_are_fp16_only_where_exact():
    from memwall.kernels.cpu.layout import LayoutError, PackedWeight
    from memwall.quant.base import scale_tables

    exact = torch.tensor([[0.5, -3.0], [1024.0, 2.0 ** -20]])
    assert [t.dtype for t in scale_tables(exact, -exact)] == [torch.float16] * 2
    for inexact in (exact + 1e-4, exact * 1e5, torch.full((2, 2), float("nan"))):
        assert [t.dtype for t in scale_tables(exact, inexact)] == [torch.float32] * 2
    codes, s, c, _ = _weight("q4", 2, 64, 32, seed=8)
    assert PackedWeight("q4", 32, 2, 64, codes, s.half(), c.half()).scale_format == 1
    assert PackedWeight("q4", 32, 2, 64, codes, s, c).scale_format == 0
    with pytest.raises(LayoutError, match="offsets"):
        PackedWeight("q4", 32, 2, 64, codes, s.half(), c)  # one table each way: refused


@pytest.mark.parametrize("kind,group,supers", [("q4", 32, 2), ("q8", 16, 2), ("q8", 32, 1),
                                               ("q4", 32, 6)])
@pytest.mark.parametrize("int_acts", [True, False])
def test_two_level_scale_tables_give_the_float32_tables_results(isa, kind, group, supers, int_acts):
    """GGUF's K-quants keep a float32 d per 256 values and an int8 sub-scale per group
    (layout.py two_level_table): every kernel widens an entry to d * sub in fp32, the very float
    a float32 table holds, so each path's result is bit-identical (one-token gemv, integer rows,
    the pair layout at 6 superblocks = 48 blocks, AVX-512 tiles, exact kernels, dequantizers).
    int8_tiles.c, which only two-level tables take past 16 tokens, is switched off here and
    checked in test_int8_tiles.py."""
    from memwall.kernels.cpu.layout import PackedWeight, float_table, two_level_table

    lib = build.lib()
    k, n = 256 * supers, 40
    codes, _, _, _ = _weight(kind, n, k, group, seed=11)
    g = torch.Generator().manual_seed(12)
    per_super = 256 // group
    d_s = torch.rand(n, supers, generator=g).half().float()  # an fp16 d, as GGUF stores it
    d_c = -torch.rand(n, supers, generator=g).half().float()
    sub_s = torch.randint(-128, 128, (n, supers * per_super), generator=g)
    sub_c = torch.randint(0, 64, (n, supers * per_super), generator=g)  # Q4_K's 6-bit mins
    s2, c2 = two_level_table(d_s, sub_s), two_level_table(d_c, sub_c)
    s = d_s.repeat_interleave(per_super, dim=1) * sub_s.float()  # what ggml computes
    c = d_c.repeat_interleave(per_super, dim=1) * sub_c.float()
    assert torch.equal(float_table(s2), s) and torch.equal(float_table(c2), c)
    assert s2.shape == (n, supers, 4 + per_super) and s2.dtype == torch.uint8
    assert PackedWeight(kind, group, n, k, codes, s2, c2).scale_format == per_super
    matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
    lib.mw_set_int_acts(int(int_acts))
    lib.mw_set_int8_tiles(0)
    try:
        for m in HALF_TOKENS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            assert torch.equal(matmul(x, codes, s2, c2), matmul(x, codes, s, c)), m
    finally:
        lib.mw_set_int_acts(0)
        lib.mw_set_int8_tiles(1)
    dequantize = ((lambda a, b: quant_ops.q4_dequantize(codes, a, b, k)) if kind == "q4"
                  else (lambda a, b: quant_ops.q8_dequantize(codes, a, b)))
    assert torch.equal(dequantize(s2, c2), dequantize(s, c))


@pytest.mark.parametrize("kind,group,table", [("q4", 32, "float32"), ("q4", 32, "fp16"),
                                               ("q4", 32, "two-level"), ("q8", 32, "fp16"),
                                               ("q8", 32, "two-level"), ("q8", 16, "two-level"),
                                               ("q8", 16, "float32")])
def test_integer_rows_do_not_depend_on_the_batch(isa, kind, group, table):
    """Up to a tile (8 tokens) the integer kernels take rows one at a time and read the tables
    in place: a token's outputs are bit-identical whether it runs alone or with 1-7 others
    (a pipeline stage or a speculative verify batches differently from a plain decode). K of
    2.5 superblocks (q4, 20 blocks) leaves a tail past the last run of 8 table entries."""
    from memwall.kernels.cpu.layout import two_level_table

    lib = build.lib()
    n = 37
    ks = (512, 640) if table != "two-level" else (512,)
    for k in ks:
        codes, s, c, _ = _weight(kind, n, k, group, seed=k)
        if table == "fp16":
            s, c = s.half(), c.half()
        elif table == "two-level":
            g = torch.Generator().manual_seed(3)
            per_super, supers = 256 // group, k // 256
            s = two_level_table(torch.rand(n, supers, generator=g), torch.randint(-128, 128, (n, supers * per_super), generator=g))
            c = two_level_table(-torch.rand(n, supers, generator=g), torch.randint(0, 64, (n, supers * per_super), generator=g))
        matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(k))
        lib.mw_set_int_acts(1)
        try:
            alone = torch.cat([matmul(x[i:i + 1].contiguous(), codes, s, c) for i in range(8)])
            for m in range(2, 9):
                assert torch.equal(matmul(x[:m].contiguous(), codes, s, c), alone[:m]), (k, m)
        finally:
            lib.mw_set_int_acts(0)
        assert not torch.equal(alone[0], alone[1])  # the tokens differ: the check could fail


def test_two_level_tables_are_checked():
    from memwall.kernels.cpu.layout import LayoutError, PackedWeight, two_level_table

    codes, s, c, _ = _weight("q4", 2, 256, 32, seed=9)
    d, sub = torch.ones(2, 1), torch.ones(2, 8, dtype=torch.int64)
    table = two_level_table(d, sub)
    with pytest.raises(LayoutError, match="offsets"):
        PackedWeight("q4", 32, 2, 256, codes, table, c)  # one table each way: refused
    short = two_level_table(torch.ones(2, 2), torch.ones(2, 4))  # 2 x 2 entries, a row needs 8
    with pytest.raises(LayoutError, match="sub-values"):
        PackedWeight("q4", 32, 2, 256, codes, short, short)
    single = two_level_table(torch.ones(2, 8), sub)  # one entry a superblock: not two-level
    with pytest.raises(LayoutError, match="sub-values"):
        PackedWeight("q4", 32, 2, 256, codes, single, single)
    with pytest.raises(LayoutError, match="signed byte"):
        two_level_table(d, sub * 200)
