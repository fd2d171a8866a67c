"""Microbenchmark: one Linear of each SmolLM2-135M shape, float vs weight-only quantized.

    python benchmarks/quant_linear.py [--threads 2] [--tokens 1 16] [--seconds 0.4]

Kernels: fp32 and bf16 ``F.linear``; torch's int8 (``_weight_int8pack_mm``) and int4
(``_weight_int4pack_mm_for_cpu``, group 32) ops with bf16 activations; and memwall's native
fp32 kernels (memwall/kernels/cpu/quant_ops.py: ``q8`` = GGUF Q8_0 layout, ``q4`` = Q4_1 layout) when a
C compiler built them. Decode is bandwidth bound and the whole model (540 MB in fp32) does
not fit in cache, so each kernel cycles through enough copies of its weight to make the fp32
working set ~600 MB ("cold", like a decode step), rather than re-reading one cached copy.
Times are a low percentile of many runs, to resist other load on the machine.

Prints a table of microseconds and tokens/s (= tokens / time: a whole model's layers run at
about the rate of its slowest shapes), and writes JSON with the CPU model to
benchmarks/results/quant_linear-<time>.json.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_result  # noqa: E402
SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
WORKING_SET = 600e6  # bytes of fp32 weights cycled through per measurement


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def timed(fns: list[Callable[[], object]], seconds: float) -> float:
    """Microseconds per call: 20th percentile over rounds of calling every fn once."""
    for f in fns[:3]:
        f()
    rounds: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(rounds) < 3:
        t = time.perf_counter()
        for f in fns:
            f()
        rounds.append((time.perf_counter() - t) / len(fns))
    rounds.sort()
    return rounds[len(rounds) // 5] * 1e6


def kernels(n: int, k: int, copies: int) -> dict[str, Callable[[torch.Tensor], list[Callable]]]:
    """name -> (x -> one closure per weight copy). Weights are random: speed only."""
    from memwall.kernels.cpu import quant_ops as native

    def each(make_weight, call):
        weights = [make_weight() for _ in range(copies)]
        return lambda x: [lambda w=w: call(x, w) for w in weights]

    q4 = lambda: torch.randint(0, 16, (n, k), dtype=torch.int32)  # noqa: E731
    out = {
        "fp32": each(lambda: torch.randn(n, k), lambda x, w: F.linear(x, w)),
        "bf16": each(lambda: torch.randn(n, k, dtype=torch.bfloat16),
                     lambda x, w: F.linear(x.bfloat16(), w)),
        "torch int8": each(lambda: (torch.randint(-127, 128, (n, k), dtype=torch.int8),
                                    torch.rand(n, dtype=torch.bfloat16)),
                           lambda x, w: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), *w)),
        "torch int4": each(lambda: (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4(), 1),
                                    torch.rand(k // 32, n, 2, dtype=torch.bfloat16)),
                           lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
                               x.bfloat16(), w[0], 32, w[1])),
    }
    if native.available():
        groups = (torch.rand(n, k // 32), torch.randn(n, k // 32))
        out["native q8"] = each(lambda: torch.randint(-128, 128, (n, k), dtype=torch.int8),
                                lambda x, w: native.q8_matmul(x, w, *groups))
        out["native q4"] = each(lambda: torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                lambda x, w: native.q4_matmul(x, w, *groups))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for label, (n, k) in SHAPES.items():
        copies = max(1, int(WORKING_SET // (n * k * 4)))
        for name, make in kernels(n, k, copies).items():
            for m in args.tokens:
                us = timed(make(torch.randn(m, k)), args.seconds)
                rows.append({"shape": label, "kernel": name, "tokens": m, "us": us,
                             "tok_per_s": m / us * 1e6})
        print_table([r for r in rows if r["shape"] == label], label, args.tokens)
    path = write_result("quant_linear", {"cpu": cpu_model(), "threads": args.threads,
                                         "torch": torch.__version__, "rows": rows}, indent=1)
    print(f"\ncpu: {cpu_model()}, {args.threads} threads, torch {torch.__version__}; wrote {path}")


def print_table(rows: list[dict], label: str, tokens: list[int]) -> None:
    base = {r["tokens"]: r["us"] for r in rows if r["kernel"] == "fp32"}
    print(f"\n{label:<18}" + "".join(f"{f'M={m} us':>12}{'x fp32':>8}" for m in tokens))
    for name in dict.fromkeys(r["kernel"] for r in rows):
        cells = {r["tokens"]: r["us"] for r in rows if r["kernel"] == name}
        print(f"  {name:<16}" + "".join(f"{cells[m]:>12.0f}{base[m] / cells[m]:>8.2f}" for m in tokens))


if __name__ == "__main__":
    main()
