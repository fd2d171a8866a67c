"""GPU benchmark: the Triton kernels against the torch reference at Llama-3-8B shapes, then
the whole engine (benchmarks/gpu_engine.py: decode tok/s at B=1/64/128 in bf16 and fp8,
8k prefill, roofline, HF transformers baseline, fp8 greedy agreement) in the same run.

    python benchmarks/gpu.py [--out FILE] [--quick] [--kernels-only]
    python benchmarks/gpu.py --smoke      # tiny shapes on any device (the CPU too): code paths
                                          # only, no timing claims; JSON only with --out

Shapes: 32 query heads on 8 KV heads, head_dim 128, hidden 4096, intermediate 14336, KV block
16, bfloat16; one layer per call. For every case the same run times the Triton kernel and its
torch baseline (memwall/attention/paged_torch.py) on the same inputs, after
checking that they agree (relative-norm error), and reports:

    ms        median of triton.testing.do_bench (L2 flushed before every call)
    GB/s      the fewest bytes the case must move (each input read once, each output written
              once) over the Triton time; compare with the device copy ceiling measured first
    TFLOP/s   attention only: 4 * heads * head_dim per (query, visible key) pair

FP8 linear rows: the weight-only Triton kernel (memwall/kernels/triton/fp8_linear.py) at
decode row counts for o_proj (4096x4096) and the fused gate_up (28672x4096), fp8 weights with a
scale per channel; "torch ms" there is fp8_scaled_mm on the same inputs (x quantized per token,
then torch._scaled_mm: what Fp8Linear ran before; NaN below compute capability 8.9), and the
JSON also keeps bf16 F.linear's time (bf16_ms). GB/s counts the fp8 weight, its scales, x and y.

Attention rows also sweep a few tile shapes (prefill rows x key tile x warps; decode key tile)
and keep every config's time in the JSON. Results go to benchmarks/results/gpu-kernels-<device>-
<timestamp>.json. Needs CUDA and triton (except --smoke); imports cleanly without either.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from memwall.attention import paged_torch, triton_backend  # noqa: E402
from memwall.attention.metadata import AttentionMetadata  # noqa: E402
from memwall.kernels.triton import TRITON_AVAILABLE  # noqa: E402
from memwall.kernels.triton import paged_attention as pa  # noqa: E402
from benchmarks.report import write_result  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336
DTYPE = torch.bfloat16
PREFILL_SWEEP = [dict(block_m=m, tile_n=n, num_warps=w, num_stages=s)
                 for m, n, w, s in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (64, 32, 4, 3),
                                    (128, 64, 8, 3)]]
DECODE_SWEEP = [dict(tile_n=n, num_warps=w) for n, w in [(32, 4), (64, 4), (128, 4), (64, 8)]]


# ---- timing ------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def ceilings() -> dict:
    """Device copy bandwidth (read + write bytes) and bf16 matmul rate, measured here."""
    n = 1 << 29  # 1 GiB of bytes
    src = torch.randn(n // 2, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = bench_ms(lambda: a @ b)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


# ---- attention ---------------------------------------------------------------------------------
def attention_step(q_lens: list[int], seq_lens: list[int], seed: int = 0):
    """Random q/k/v, a random bf16 cache holding every prefix, scattered block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, BLOCK, device="cuda")
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE)
    t = sum(q_lens)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, meta


def attention_cost(q_lens: list[int], seq_lens: list[int]) -> tuple[float, float]:
    """(fewest bytes, FLOPs) of one layer's attention for this batch."""
    elem = torch.finfo(DTYPE).bits // 8
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * elem
    q_out_bytes = 2 * sum(q_lens) * HEADS * HEAD_DIM * elem
    pairs = sum(sum(s - q + i + 1 for i in range(q)) for q, s in zip(q_lens, seq_lens))
    return kv_bytes + q_out_bytes, 4.0 * HEADS * HEAD_DIM * pairs


def torch_attention(q, k_cache, v_cache, meta, scale):
    with torch.device("cuda"):  # paged_torch builds its masks with factory defaults
        return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale)


def attention_case(name: str, q_lens: list[int], seq_lens: list[int], sweep: list[dict]) -> dict:
    q, k_cache, v_cache, meta = attention_step(q_lens, seq_lens)
    scale = HEAD_DIM ** -0.5
    ref = torch_attention(q, k_cache, v_cache, meta, scale)
    torch_ms = bench_ms(lambda: torch_attention(q, k_cache, v_cache, meta, scale))
    configs = []
    for knobs in sweep:
        out = triton_backend.paged_attention(q, k_cache, v_cache, meta, scale, **knobs)
        err = rel_err(out, ref)
        ms = bench_ms(lambda: triton_backend.paged_attention(q, k_cache, v_cache, meta, scale, **knobs))
        configs.append({"knobs": knobs, "ms": ms, "rel_err": err})
    best = min(configs, key=lambda c: c["ms"])
    nbytes, flops = attention_cost(q_lens, seq_lens)
    return row(name, best["ms"], torch_ms, nbytes, flops, max(c["rel_err"] for c in configs),
               best=best["knobs"], configs=configs)


def attention_cases(quick: bool) -> list[dict]:
    cases = []
    for batch, ctx in ([(1, 4096), (32, 2048)] if quick else
                       [(1, 1024), (1, 8192), (8, 4096), (32, 2048), (128, 1024), (256, 2048)]):
        cases.append(attention_case(f"decode B={batch} ctx={ctx}", [1] * batch, [ctx] * batch,
                                    DECODE_SWEEP))
    prefills = [("prefill 4x1024 from 0", [1024] * 4, [1024] * 4),
                ("prefill 2x512 on 3584 cached", [512] * 2, [4096] * 2),
                ("prefill 1x4096 from 0", [4096], [4096])]
    for name, q_lens, seq_lens in prefills[:1] if quick else prefills:
        cases.append(attention_case(name, q_lens, seq_lens, PREFILL_SWEEP))
    mixed_q, mixed_s = [1] * 64 + [512], [2048] * 64 + [1024]
    cases.append(attention_case("mixed 64 decodes + 512 chunk", mixed_q, mixed_s, [{}]))
    return cases


# ---- the other kernels -------------------------------------------------------------------------
def write_kv_case(tokens: int) -> dict:
    q_lens, seq_lens = [tokens], [tokens]
    _, k_cache, v_cache, meta = attention_step(q_lens, seq_lens)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    paged_torch.write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
    pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    err = max(rel_err(k_cache, ref_k), rel_err(v_cache, ref_v))
    t_ms = bench_ms(lambda: pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping))
    r_ms = bench_ms(lambda: paged_torch.write_kv(ref_k, ref_v, k, v, meta.slot_mapping))
    return row(f"write_kv T={tokens}", t_ms, r_ms, 4 * k.numel() * k.element_size(), 0.0, err)


# ---- fp8 weights ---------------------------------------------------------------------------------
FP8_SHAPES = [(HIDDEN, HIDDEN), (2 * INTER, HIDDEN)]  # (N, K): o_proj, gate_up fused


def fp8_linear_case(m: int, n: int, k: int) -> dict:
    from memwall.kernels.triton import fp8_linear as fl
    from memwall.quant.fp8 import (dequantize_fp8_rows, fp8_scaled_mm, quantize_fp8_rows,
                                   scaled_mm_supported)

    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    q, scale = quantize_fp8_rows(w)
    del w
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    ref = x.float() @ dequantize_fp8_rows(q, scale).T  # the same fp8 numbers, x unquantized
    err = rel_err(fl.fp8_linear(x, q, scale), ref)
    t_ms = bench_ms(lambda: fl.fp8_linear(x, q, scale))
    s_ms = (bench_ms(lambda: fp8_scaled_mm(x, q, scale)) if scaled_mm_supported(x.device)
            else float("nan"))
    w16 = dequantize_fp8_rows(q, scale, DTYPE)
    bf16_ms = bench_ms(lambda: torch.nn.functional.linear(x, w16))
    cfg = fl.pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    nbytes = n * k + 4 * n + 2 * (m * k + m * n)  # fp8 weight, fp32 scales, bf16 x and y
    return row(f"fp8 linear M={m} {n}x{k}", t_ms, s_ms, nbytes, 2.0 * m * n * k, err,
               best=f"split_k={cfg.split_k} block_n={cfg.block_n} block_m={cfg.block_m}",
               bf16_ms=bf16_ms, bf16_GBps=2 * n * k / bf16_ms / 1e6)


# ---- report ------------------------------------------------------------------------------------
def row(name: str, triton_ms: float, torch_ms: float, nbytes: float, flops: float, err: float,
        **extra) -> dict:
    return {"case": name, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "speedup": torch_ms / triton_ms, "GBps": nbytes / triton_ms / 1e6,
            "TFLOPs": flops / triton_ms / 1e9, "rel_err": err, **extra}


def print_table(rows: list[dict], ceil: dict) -> None:
    print(f"\nceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'case':34} {'triton ms':>10} {'torch ms':>10} {'speedup':>8} {'GB/s':>7} "
          f"{'%copy':>6} {'TFLOP/s':>8} {'rel err':>8}  best")
    for r in rows:
        print(f"{r['case']:34} {r['triton_ms']:10.4f} {r['torch_ms']:10.4f} {r['speedup']:8.2f} "
              f"{r['GBps']:7.0f} {100 * r['GBps'] / ceil['copy_GBps']:6.1f} {r['TFLOPs']:8.1f} "
              f"{r['rel_err']:8.1e}  {r.get('best', '')}")


def run(quick: bool) -> dict:
    ceil = ceilings()
    rows = attention_cases(quick)
    for tokens in ([256] if quick else [256, 4096]):
        rows.append(write_kv_case(tokens))
    for m in ([1, 16] if quick else [1, 16, 32]):  # 32: Fp8Linear's SMALL_M_MAX
        for n, k in FP8_SHAPES:
            rows.append(fp8_linear_case(m, n, k))
    print_table(rows, ceil)
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                       "hidden": HIDDEN, "intermediate": INTER, "dtype": str(DTYPE)},
            "ceilings": ceil, "cases": rows, "max_rel_err": max(r["rel_err"] for r in rows)}


def smoke(out: Path | None) -> int:
    """Every engine-level piece at tiny shapes on this machine's device; proves code paths only."""
    from benchmarks import gpu_engine

    result = gpu_engine.run(smoke=True)
    gpu_engine.print_engine(result)
    print("\n--smoke: tiny shapes, code paths only; these numbers measure nothing")
    if out is not None:
        write_result("gpu-smoke", {"smoke": True, **result}, out)
        print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/gpu-*.json)")
    parser.add_argument("--quick", action="store_true", help="fewer cases and shorter runs")
    parser.add_argument("--kernels-only", action="store_true", help="skip the whole-engine part")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny engine shapes on any device, CPU included (no timing claims)")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(args.out)
    if not (torch.cuda.is_available() and TRITON_AVAILABLE):
        print("benchmarks/gpu.py needs a CUDA device and triton; found "
              f"cuda={torch.cuda.is_available()} triton={TRITON_AVAILABLE}", file=sys.stderr)
        return 2
    result = run(args.quick)
    if not args.kernels_only:
        from benchmarks import gpu_engine

        start = time.perf_counter()
        result["engine"] = gpu_engine.run(quick=args.quick, copy_GBps=result["ceilings"]["copy_GBps"])
        result["engine"]["seconds"] = time.perf_counter() - start
        gpu_engine.print_engine(result["engine"])
    device = result["device"].replace(" ", "-")
    out = write_result(f"gpu-{device}", result, args.out)
    print(f"\nwrote {out}")
    bad = [r["case"] for r in result["cases"] if not math.isfinite(r["rel_err"]) or r["rel_err"] > 2e-2]
    if bad:
        print(f"ERROR: results disagree with the torch reference (rel err > 2e-2): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
