"""Throughput against the number of sequences in flight, one engine in process.

The lowest concurrency is the baseline in the same run (issue 14: memwall's c=16 >= 1.3x its
own c=4).

    python benchmarks/batch_scaling.py [--model GGUF] [--threads 2] [--concurrency 4,16]
                                       [--requests-per-slot 4] [--prompt-tokens 128]
                                       [--max-tokens 128] [--runs 3]

One engine (``max_num_seqs`` = the largest concurrency, its step budget measured at start-up as
under ``memwall serve``) serves closed loops: at concurrency c, c requests in flight and a new
one as soon as one finishes, ``requests-per-slot`` x c requests in all, each a prompt of random
common words and exactly ``max-tokens`` greedy tokens (ignore_eos), as ``serve.py``'s random
set. Every run draws fresh prompts, so the prefix cache serves nothing. The concurrencies take
turns within a run (the order reversed every other run): this VM's speed drifts by a third
within minutes, and whole runs minutes apart compared its moments more than the batch sizes.

Reported per concurrency (medians over runs): output tokens/s; the decode steps (every
sequence in flight past its first token): their time, per token, and the fused C step's stage
timers per step (`mw_profile`; the rest is the LM head, sampling and Python); prefill tokens/s
(the steps with some prompt in them). Per run: each concurrency's throughput over the lowest's,
end to end and decode steps only (the ratio with free prefill). No server: what ``serve.py
compare`` adds (the API process, IPC) is a cost per step on top. Writes
benchmarks/results/batch_scaling-<time>.json with the CPU model.
"""

from __future__ import annotations

import ctypes
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import datasets  # noqa: E402
from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import engine_bench_parser, write_result  # noqa: E402

STAGES = ("norms", "qkv", "rope_kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down",
          "lora", "tp_all_reduce")  # decode.c's mw_profile stages, in its order


@dataclass
class LoopResult:
    """One closed loop at one concurrency."""

    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    prefill_tokens: int
    prefill_seconds: float
    decode_steps: int
    decode_rows: int
    decode_seconds: float
    decode_step_ms: list[float] = field(default_factory=list)  # p10, p50, p90
    stage_ms_per_step: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return self.decode_rows / self.decode_seconds if self.decode_seconds else 0.0


class StageTimers:
    """decode.c's per-stage timers, where this build has the native kernels (else empty)."""

    def __init__(self) -> None:
        from memwall.kernels.cpu import build

        self.lib = build.lib()

    def start(self) -> None:
        if self.lib is not None:
            self.lib.mw_profile(1, None)

    def stop(self) -> list[float]:
        if self.lib is None:
            return []
        buf = (ctypes.c_double * len(STAGES))()
        self.lib.mw_profile(0, buf)
        return list(buf)


def closed_loop(llm, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str,
                timers: StageTimers) -> LoopResult:
    """Serves ``prompts`` with ``concurrency`` in flight; times every engine step."""
    from memwall import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, min_tokens=max_tokens,
                            max_tokens=max_tokens)
    queue = list(enumerate(prompts))
    in_flight: set[str] = set()
    started: set[str] = set()  # in flight with their first token out
    steps: list[float] = []
    prefill_s = decode_s = 0.0
    decode_rows = output_tokens = 0

    def admit() -> None:
        while queue and len(in_flight) < concurrency:
            i, ids = queue.pop(0)
            llm.engine.add_request(f"{tag}-{i}", ids, params)
            in_flight.add(f"{tag}-{i}")

    admit()
    timers.start()
    begin = time.perf_counter()
    while in_flight:
        decode_only, rows = started >= in_flight, len(in_flight)
        t0 = time.perf_counter()
        outputs = llm.engine.step()
        seconds = time.perf_counter() - t0
        if decode_only:
            decode_s += seconds
            decode_rows += rows
            steps.append(seconds)
        else:
            prefill_s += seconds
        for out in outputs:
            if out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                output_tokens += len(out.outputs[0].token_ids)
                in_flight.discard(out.request_id)
                started.discard(out.request_id)
        admit()
    total = time.perf_counter() - begin
    stages = timers.stop()
    steps.sort()
    pct = [1e3 * steps[min(len(steps) - 1, int(q * len(steps)))] for q in (0.1, 0.5, 0.9)] if steps else []
    per_step = {name: 1e3 * s / len(steps) for name, s in zip(STAGES, stages) if steps and s > 0}
    return LoopResult(concurrency, len(prompts), output_tokens, total,
                      sum(len(p) for p in prompts), prefill_s, len(steps), decode_rows, decode_s,
                      pct, per_step)


def random_prompts(tok, count: int, length: int, rng: random.Random) -> list[list[int]]:
    return [tok.encode(datasets.random_prompt(tok, length, rng)) for _ in range(count)]


def main() -> None:
    parser = engine_bench_parser(__doc__)  # --model, --threads, --runs, --max-tokens
    parser.add_argument("--concurrency", default="4,16", help="comma-separated; the lowest is the baseline")
    parser.add_argument("--requests-per-slot", type=int, default=4,
                        help="requests a run sends at concurrency c: this times c (serve.py: 64 at c=16)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1 or args.runs < 1 or args.requests_per_slot < 1:
        raise SystemExit("batch_scaling: --concurrency needs positive integers; --runs and "
                         "--requests-per-slot at least 1")

    from memwall import LLM

    llm = LLM(args.model, threads=args.threads, max_num_seqs=max(levels))
    budget = llm.engine.core.scheduler.config.max_num_batched_tokens
    tok, rng, timers = llm.tokenizer, random.Random(args.seed), StageTimers()
    closed_loop(llm, random_prompts(tok, 2, args.prompt_tokens, rng), 2, 8, "warmup", timers)
    runs: list[dict[int, LoopResult]] = []
    for run in range(args.runs):
        order = levels if run % 2 == 0 else levels[::-1]
        results = {}
        for c in order:
            prompts = random_prompts(tok, args.requests_per_slot * c, args.prompt_tokens, rng)
            results[c] = closed_loop(llm, prompts, c, args.max_tokens, f"run{run}-c{c}", timers)
            r = results[c]
            print(f"run {run + 1} c={c}: {r.tok_s:.1f} tok/s, decode step p50 "
                  f"{r.decode_step_ms[1] if r.decode_step_ms else float('nan'):.2f} ms, "
                  f"prefill {r.prefill_tokens / r.prefill_seconds:.0f} tok/s", flush=True)
        runs.append(results)

    base = levels[0]
    med = statistics.median
    print(f"\n{cpu_model()}, {args.threads} threads, step budget {budget} tokens; "
          f"{args.prompt_tokens} in / {args.max_tokens} out; medians of {args.runs} runs")
    header = f"{'c':>4} {'tok/s':>8} {'step p50 ms':>12} {'ms/token':>9} {'prefill tok/s':>14}"
    header += f" {'x c=' + str(base):>10} {'decode only':>12}"
    print(header)
    summary = {}
    for c in levels:
        rows = [r[c] for r in runs]
        ratios = [r[c].tok_s / r[base].tok_s for r in runs]
        decode_ratios = [r[c].decode_tok_s / r[base].decode_tok_s for r in runs
                         if r[base].decode_tok_s and r[c].decode_tok_s]
        step = med([x.decode_step_ms[1] for x in rows if x.decode_step_ms] or [float("nan")])
        summary[c] = {
            "tok_s": med(x.tok_s for x in rows),
            "decode_step_ms_p50": step,
            "decode_ms_per_token": step / c,
            "prefill_tok_s": med(x.prefill_tokens / x.prefill_seconds for x in rows),
            "ratio_per_run": ratios, "ratio": med(ratios),
            "decode_only_ratio_per_run": decode_ratios,
            "decode_only_ratio": med(decode_ratios) if decode_ratios else None,
            "stage_ms_per_step": {name: med(x.stage_ms_per_step.get(name, 0.0) for x in rows)
                                  for name in STAGES if any(name in x.stage_ms_per_step for x in rows)},
        }
        s = summary[c]
        print(f"{c:>4} {s['tok_s']:>8.1f} {step:>12.2f} {s['decode_ms_per_token']:>9.3f} {s['prefill_tok_s']:>14.0f}"
              f" {s['ratio']:>10.3f} {s['decode_only_ratio'] or float('nan'):>12.3f}")
    for c in levels:
        stages = summary[c]["stage_ms_per_step"]
        if stages:
            known = sum(stages.values())
            print(f"c={c} decode step stages (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
                  + f"; rest (LM head, sampling, Python) {summary[c]['decode_step_ms_p50'] - known:.2f}")
    path = write_result("batch_scaling", {
        "cpu": cpu_model(), "threads": args.threads, "model": args.model or "embedded SmolLM2 Q4_1",
        "step_budget": budget, "settings": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "summary": summary, "runs": [{c: asdict(r) for c, r in run.items()} for run in runs]},
        Path(args.result_file) if args.result_file else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
