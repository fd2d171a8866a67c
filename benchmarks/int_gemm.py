"""Quantized matmuls by batch size: integer activations (int_gemm.c) against the exact fp32
kernels (quant_gemm.c) and against dequantize + fp32 BLAS, on SmolLM2-135M's and a
Llama-3.2-1B's projection shapes, in one run.

    python benchmarks/int_gemm.py [--threads 2] [--tokens 1,2,4,8,16,32,64,96,128,256,512]
                                  [--repeats 3] [--shapes smollm2,1b]

Each cell is the median of ``--repeats`` timings, each the best of a few calls (the weights
are random codes in memwall's q4/q8 layouts; only the arithmetic matters). Reported per shape
and token count: milliseconds of each path and the speedups int/exact and int/BLAS; the
crossover where BLAS overtakes the integer kernels is what quant_ops.INT_ACTS_MAX_TOKENS is set
from. Writes benchmarks/results/int_gemm-<time>.json with the CPU model and its flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import write_result  # noqa: E402
from memwall.kernels.cpu import build, quant_ops  # noqa: E402

# (name, kind, N, K): q/k/v/o, gate_up, down of each model, and SmolLM2's tied LM head (Q8_0)
SHAPES = {
    "smollm2": [("qkv", "q4", 960, 576), ("gate_up", "q4", 3072, 576), ("down", "q4", 576, 1536),
                ("lm_head", "q8", 49152, 576)],
    "1b": [("qkv", "q4", 3072, 2048), ("gate_up", "q4", 16384, 2048), ("down", "q4", 2048, 8192)],
}


def _weight(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    if kind == "q4":
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    return codes, torch.rand(n, k // 32, generator=g) * 0.01, -torch.rand(n, k // 32, generator=g) * 0.08


def _time(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,96,128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default="smollm2,1b")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = build.require()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    print(f"CPU: {cpu_model()}, {args.threads} threads, integer path: {quant_ops.int_gemm_isa()}")
    print(f"{'shape':>18} {'M':>4} {'exact ms':>9} {'int ms':>8} {'BLAS ms':>8} "
          f"{'int/exact':>9} {'int/BLAS':>8}")
    for family in args.shapes.split(","):
        for name, kind, n, k in SHAPES[family]:
            codes, s, c = _weight(kind, n, k)
            matmul = quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul
            dequantize = ((lambda: quant_ops.q4_dequantize(codes, s, c, k)) if kind == "q4"
                          else (lambda: quant_ops.q8_dequantize(codes, s, c)))
            for m in tokens:
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                gemm = lib.q4_gemm if kind == "q4" else lib.q8_gemm
                grouped = () if kind == "q4" else (32,)
                ptrs = (*grouped, codes.data_ptr(), s.data_ptr(), c.data_ptr(), y.data_ptr(), n,
                        int(s.dtype == torch.float16))
                integer = lib.mw_q4_gemm_i16 if kind == "q4" else lib.mw_q8_gemm_i16
                samples = {"exact": [], "int": [], "blas": []}
                for _ in range(args.repeats):  # alternate the paths: drift hits all alike
                    quant_ops.set_int_acts(False)
                    samples["exact"].append(_time(lambda: gemm(x.data_ptr(), m, k, *ptrs)))
                    quant_ops.set_int_acts(True)
                    samples["int"].append(_time(lambda: integer(x.data_ptr(), m, k, *ptrs)))
                    samples["blas"].append(_time(lambda: torch.nn.functional.linear(x, dequantize())))
                med = {p: statistics.median(v) * 1e3 for p, v in samples.items()}
                row = {"model": family, "proj": name, "kind": kind, "n": n, "k": k, "tokens": m,
                       "exact_ms": med["exact"], "int_ms": med["int"], "blas_ms": med["blas"],
                       "int_vs_exact": med["exact"] / med["int"], "int_vs_blas": med["blas"] / med["int"]}
                rows.append(row)
                print(f"{family + ' ' + name:>18} {m:>4} {med['exact']:9.3f} {med['int']:8.3f} "
                      f"{med['blas']:8.3f} {row['int_vs_exact']:8.2f}x {row['int_vs_blas']:7.2f}x")
    quant_ops.set_int_acts(True)
    path = write_result("int_gemm", {"benchmark": "int_gemm", "cpu": cpu_model(),
                                     "cpu_flags": sorted(f for f in build.cpu_flags()
                                                         if f.startswith(("avx", "fma", "amx"))),
                                     "threads": args.threads, "int_path": quant_ops.int_gemm_isa(),
                                     "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
