"""Split-K sweep of the Triton fp8 weight-only kernel (memwall/kernels/triton/fp8_linear.py) at
Llama-3-8B's projection shapes, beside torch._scaled_mm on the same inputs: the measurement
behind ``SPLIT_K_MIN_K``.

    python benchmarks/gpu_fp8_split_k.py [--out FILE]      # needs CUDA and triton

Each row: M tokens of bf16 x against an N x K fp8 weight; ms is the median of
triton.testing.do_bench (L2 flushed before every call) at split_k 1, 2, 4, 8, the split
pick_config chooses, and fp8_scaled_mm. Prints one JSON line a case and writes them all to
benchmarks/results/gpu-fp8-split-k-<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import write_result  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096)]  # o, qkv, down, gate_up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_fp8_split_k: needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from memwall.kernels.triton.fp8_linear import fp8_linear, pick_config
    from memwall.quant.fp8 import fp8_scaled_mm, quantize_fp8_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in SHAPES:
        q, s = quantize_fp8_rows(torch.randn(n, k, device="cuda") * 0.02)
        for m in (1, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            picked = pick_config(m, n, k, sms)
            row = {"m": m, "n": n, "k": k, "picked_split": picked.split_k}
            for split in (1, 2, 4, 8):
                cfg = dataclasses.replace(picked, split_k=split)
                row[f"split{split}_ms"] = do_bench(lambda: fp8_linear(x, q, s, config=cfg),
                                                   warmup=25, rep=100, return_mode="median")
            row["scaled_mm_ms"] = do_bench(lambda: fp8_scaled_mm(x, q, s), warmup=25, rep=100,
                                           return_mode="median")
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result("gpu-fp8-split-k", {"device": torch.cuda.get_device_name(0), "rows": rows},
                 args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
