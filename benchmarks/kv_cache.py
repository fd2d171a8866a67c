"""KV cache formats on the CPU: decode speed at a long context, with fp32 KV as the baseline in
the same run (issue 14: int8 KV >= 1.3x fp32 KV tokens/s at 4k context, batch 8).

    python benchmarks/kv_cache.py [--model GGUF] [--threads 2] [--context 4096] [--batch 8]
                                  [--steps 8] [--runs 3] [--formats fp32,int8,fp16]

One engine per format (``LLM(kv_cache_dtype=...)``, the embedded SmolLM2 by default), each
with a KV pool of exactly ``batch`` sequences of ``context`` tokens, filled with random K/V
written in the format (attention's cost does not depend on the values). A step is what the
runner does for a decode-only batch: the fused C decode step (all layers, paged attention
over the whole context) and the LM head. Formats alternate within each run; the table shows
the median of ``--runs`` runs of ``--steps`` steps each, and the KV bytes each step reads.
Writes benchmarks/results/kv_cache-<time>.json with the CPU model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402
from benchmarks.servers import embedded_gguf  # noqa: E402

BLOCK = 16


class Bench:
    """One engine holding ``batch`` sequences of ``context`` tokens in one KV format."""

    def __init__(self, model: str, fmt: str, threads: int, context: int, batch: int) -> None:
        import torch

        from memwall import LLM
        from memwall.attention import kv_quant

        blocks = -(-context // BLOCK)
        self.llm = LLM(model, kv_cache_dtype=fmt, threads=threads, num_kv_blocks=batch * blocks,
                       block_size=BLOCK, max_model_len=context + 16, max_num_seqs=batch)
        self.runner = self.llm.engine.core.executor.worker.runner
        if self.runner.fast_path is None:
            raise RuntimeError("the fused C decode step is not available (no C compiler?)")
        g = torch.Generator().manual_seed(0)
        arch = self.runner.arch
        slots = torch.arange(batch * blocks * BLOCK)
        for pair in self.runner.kv_caches:
            for cache in pair:
                kv_quant.write(cache, torch.randn(len(slots), arch.num_key_value_heads,
                                                  arch.head_dim, generator=g), slots)
        self.tables = torch.arange(batch * blocks).view(batch, blocks)
        self.lens = torch.full((batch,), context, dtype=torch.long)
        self.positions = self.lens - 1
        self.slots = self.tables[:, -1] * BLOCK + (context - 1) % BLOCK
        self.ids = torch.randint(0, arch.vocab_size, (batch,), generator=g)
        self.describe = self.llm.engine.describe()

    def steps(self, count: int) -> float:
        """Seconds per decode step (fused C step + LM head), over ``count`` steps."""
        import torch

        model, decoder = self.runner.model, self.runner.fast_path.decoder
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(count):
                x = model.model.embed_tokens(self.ids)
                hidden = decoder.step(x, self.positions, self.slots, self.lens, self.tables)
                model.compute_logits(hidden).argmax(-1)
        return (time.perf_counter() - start) / count


def kv_bytes_per_token(bench: Bench) -> int:
    from memwall.worker.kv_cache import bytes_per_token

    return bytes_per_token(bench.runner.arch, bench.runner.kv_caches[0][0].dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--formats", default="fp32,int8,fp16",
                        help="comma-separated kv_cache_dtype values; fp32 is always run first")
    args = parser.parse_args()
    model = str(args.model or embedded_gguf())
    formats = ["fp32"] + [f for f in args.formats.split(",") if f and f != "fp32"]
    benches = {f: Bench(model, f, args.threads, args.context, args.batch) for f in formats}
    for bench in benches.values():
        bench.steps(1)  # warm-up: first-touch page faults, thread pool start
    seconds: dict[str, list[float]] = {f: [] for f in formats}
    for run in range(args.runs):  # formats alternate within each run
        for fmt, bench in benches.items():
            seconds[fmt].append(bench.steps(args.steps))
        print(f"run {run + 1}: " + ", ".join(f"{f} {s[-1] * 1e3:.1f} ms" for f, s in seconds.items()),
              flush=True)
    base = statistics.median(seconds["fp32"])
    rows = []
    for fmt in formats:
        step = statistics.median(seconds[fmt])
        per_token = kv_bytes_per_token(benches[fmt])
        rows.append({"format": fmt, "step_ms": step * 1e3, "tokens_per_s": args.batch / step,
                     "vs_fp32": base / step, "kv_bytes_per_token": per_token,
                     "kv_bytes_per_step": per_token * args.batch * args.context,
                     "runs_ms": [s * 1e3 for s in seconds[fmt]]})
    report = {"benchmark": "kv_cache", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpu": cpu_model(), "model": model, "threads": args.threads,
              "context": args.context, "batch": args.batch, "steps": args.steps,
              "runs": args.runs, "engine": benches["fp32"].describe, "results": rows}
    print(f"{report['cpu']}, {args.threads} threads, decode at {args.context} context, batch "
          f"{args.batch}: median of {args.runs} runs x {args.steps} steps")
    print(f"{'KV':>6}{'bytes/token':>13}{'KV MiB/step':>13}{'ms/step':>10}{'tokens/s':>10}{'vs fp32':>9}")
    for r in rows:
        print(f"{r['format']:>6}{r['kv_bytes_per_token']:>13}{r['kv_bytes_per_step'] / 2**20:>13.0f}"
              f"{r['step_ms']:>10.1f}{r['tokens_per_s']:>10.1f}{r['vs_fp32']:>8.2f}x")
    path = write_result("kv_cache", report)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
