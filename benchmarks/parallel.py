"""Parallelism on one CPU box: tensor, pipeline and data parallel against one engine, one run.

    python benchmarks/parallel.py [--model GGUF] [--output-len 128] [--runs 3]

Every setting is a `memwall serve` pinned to the same cores (2 here): the baseline is one
engine with two threads; the parallel settings run one thread a rank (or a replica):

    tp1        one engine, 2 threads                               (the baseline)
    tp2        --tensor-parallel-size 2, shared-memory all-reduce  (1 thread a rank)
    tp2-gloo   the same with torch.distributed's gloo all-reduce
    pp2        --pipeline-parallel-size 2, one step a stage in flight
    dp2        --data-parallel-size 2, requests routed by prefix affinity and load

Output tokens/s at concurrency 1 and 16 (random 32-token prompts, greedy, ignore_eos), the
median of --runs runs each, and the ratio to tp1. Also:
* pp2's bubble: the share of the wall time its stages sat idle at c=16, measured in process
  (offline LLM) from each stage's busy seconds;
* dp2 vs tp1 on the chat workload of benchmarks/prefix.py (multi-turn ShareGPT conversations,
  each turn resending the whole history) at c=16: the prefix-cache hit rate and throughput.
JSON goes to benchmarks/results/parallel-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.datasets import GGUFTokenizer, sample_random  # noqa: E402
from benchmarks.loadgen import LoadConfig, run_load  # noqa: E402
from benchmarks.metrics import summarize  # noqa: E402
from benchmarks.prefix import cache_counters, chat_workload, replay  # noqa: E402
from benchmarks.report import write_result  # noqa: E402
from benchmarks.servers import ManagedServer, ServerCommand, embedded_gguf, free_port, pin_prefix  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CORES = 2
SETTINGS = {
    "tp1": ["--threads", "2"],
    "tp2": ["--threads", "1", "--tensor-parallel-size", "2"],
    "tp2-gloo": ["--threads", "1", "--tensor-parallel-size", "2", "--tp-comm", "gloo"],
    "pp2": ["--threads", "1", "--pipeline-parallel-size", "2"],
    "dp2": ["--threads", "1", "--data-parallel-size", "2"],
    # not run by default: one engine with one thread, to tell numerics from routing in the chat
    # workload (its histories are the model's own replies, which depend on the thread count)
    "tp1-1t": ["--threads", "1"],
}
DEFAULT_SETTINGS = ("tp1", "tp2", "tp2-gloo", "pp2", "dp2")
CHAT_SETTINGS = ("tp1", "dp2", "tp1-1t")


def serve_command(model: Path, port: int, extra: list[str]) -> ServerCommand:
    exe = REPO / ".venv" / "bin" / "memwall"
    argv = [str(exe) if exe.exists() else "memwall", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", "16", "--max-model-len", "8192",
            "--no-show-progress", *extra]
    return ServerCommand("memwall", pin_prefix(CORES) + argv)


def throughput(base_url: str, requests, concurrency: int) -> float:
    cfg = LoadConfig(base_url=base_url, concurrency=concurrency, ignore_eos=True)
    results, duration = asyncio.run(run_load(cfg, requests))
    summary = summarize(results, duration)
    if summary.failed:
        raise RuntimeError(f"{summary.failed} requests failed: {results[0].error}")
    return summary.output_throughput


def run_setting(name: str, args, tok) -> dict:
    port = free_port()
    out: dict = {"args": SETTINGS[name]}
    if not args.chat_only:
        with ManagedServer(serve_command(args.model, port, SETTINGS[name]), port) as server:
            measure_throughput(name, args, tok, server.base_url, out)
    if name in CHAT_SETTINGS and not args.skip_chat:
        workloads = [("chat", False)] + ([("chat_recorded", True)] if args.chat_recorded else [])
        for key, recorded in workloads:
            port = free_port()  # a fresh server: an empty prefix cache for each workload
            with ManagedServer(serve_command(args.model, port, SETTINGS[name]), port) as server:
                out[key] = chat_run(server.base_url, args, tok, recorded=recorded)
    return out


def measure_throughput(name: str, args, tok, base_url: str, out: dict) -> None:
    warm = sample_random(tok, 4, 32, 8, seed=99)
    throughput(base_url, warm, 4)
    for concurrency in (1, 16):
        count = 2 if concurrency == 1 else 32
        rates = []
        for run in range(args.runs):
            requests = sample_random(tok, count, 32, args.output_len, seed=run)
            rates.append(throughput(base_url, requests, concurrency))
        out[f"c{concurrency}_runs"] = rates
        out[f"c{concurrency}"] = statistics.median(rates)
        print(f"  {name} c={concurrency}: {out[f'c{concurrency}']:.1f} out tok/s "
              f"(runs {', '.join(f'{r:.1f}' for r in rates)})", file=sys.stderr, flush=True)


def chat_run(base_url: str, args, tok, recorded: bool) -> dict:
    """benchmarks/prefix.py's chat workload with its defaults (16 ShareGPT conversations of 8
    turns, replies as long as the recorded ones up to 256 tokens, histories up to 6000 tokens)
    at c=16: one conversation a slot, its turns one after another. "chat" sends
    back the model's own replies (prompts then depend on the engine's exact numerics: one
    thread a replica rounds differently from two threads, so the histories differ slightly);
    "chat-recorded" sends back ShareGPT's recorded replies (the same prompts for every setting:
    what routing alone does to the hit rate)."""
    convs = chat_workload(tok, args.conversations, args.turns, 6000, 256, seed=0,
                          recorded_replies=recorded)
    before = cache_counters(base_url)
    results, duration = asyncio.run(replay(base_url, convs, 16, 256))
    after = cache_counters(base_url)
    queries = after.get("queries", 0) - before.get("queries", 0)
    hits = after.get("hits", 0) - before.get("hits", 0)
    summary = summarize(results, duration)
    chat = {"requests": len(results), "failed": summary.failed,
            "output_tok_s": summary.output_throughput, "prompt_tokens": queries,
            "hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0}
    label = "chat-recorded" if recorded else "chat"
    print(f"  {label}: {chat}", file=sys.stderr, flush=True)
    return chat


def pipeline_bubble(args, tok) -> dict:
    """pp2 in process at c=16: each stage's idle share of the wall time."""
    from memwall import LLM, SamplingParams

    llm = LLM(str(args.model), pipeline_parallel_size=2, threads=1, max_num_seqs=16)
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        prompts = [r.prompt for r in sample_random(tok, 16, 32, 8, seed=5)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))
        executor = llm.engine.core.executor
        before = executor._call("busy_seconds")
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        busy = [b - a for a, b in zip(before, executor._call("busy_seconds"))]
    finally:
        llm.shutdown()
    idle = [1 - b / wall for b in busy]
    result = {"wall_s": wall, "stage_busy_s": busy, "stage_idle": idle,
              "bubble": statistics.mean(idle)}
    print(f"  pp2 bubble at c=16: {result['bubble']:.1%} (stages idle "
          f"{', '.join(f'{i:.1%}' for i in idle)})", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chat-recorded", action="store_true",
                        help="also the chat workload with ShareGPT's recorded replies")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--chat-only", action="store_true",
                        help="only the chat workloads (of tp1, dp2, tp1-1t), no throughput runs")
    args = parser.parse_args()
    args.model = args.model or embedded_gguf()
    tok = GGUFTokenizer(args.model)
    names = args.settings.split(",")
    if args.chat_only:
        names = [n for n in names if n in CHAT_SETTINGS]
    results = {name: run_setting(name, args, tok) for name in names}
    bubble = pipeline_bubble(args, tok) if "pp2" in names and not args.chat_only else None
    base = results.get("tp1")
    print(f"\nCPU: {cpu_model()}, {CORES} cores; model {args.model.name}; {args.output_len} "
          f"output tokens; median of {args.runs} runs")
    print(f"{'setting':<10} {'c=1 tok/s':>10} {'ratio':>6} {'c=16 tok/s':>11} {'ratio':>6}")
    for name, r in results.items():
        if "c1" not in r:
            continue
        ratios = [r[k] / base[k] if base else float("nan") for k in ("c1", "c16")]
        print(f"{name:<10} {r['c1']:>10.1f} {ratios[0]:>6.2f} {r['c16']:>11.1f} {ratios[1]:>6.2f}")
    if bubble:
        print(f"pp2 bubble at c=16: {bubble['bubble']:.1%} of the stages' time idle")
    for key, label in (("chat", "chat"), ("chat_recorded", "chat-recorded")):
        for name in CHAT_SETTINGS:
            chat = results.get(name, {}).get(key)
            if chat:
                print(f"{label} workload c=16, {name}: hit rate {chat['hit_rate']:.3f} "
                      f"({chat['hit_tokens']:.0f} of {chat['prompt_tokens']:.0f} prompt tokens), "
                      f"{chat['output_tok_s']:.1f} out tok/s")
    path = write_result("parallel", {"cpu": cpu_model(), "cores": CORES, "model": args.model.name,
                                     "output_len": args.output_len, "runs": args.runs,
                                     "settings": results, "pp2_bubble": bubble})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
