"""Peak resident memory: memwall vs llama.cpp, same GGUF, same context, same request.

    python benchmarks/memory.py [--model GGUF | --synthetic llama-1b] [--threads 2] [--ctx 4096]
                                [--prompt-tokens 512] [--decode-tokens 128] [--runs 3]
                                [--engines memwall,llama.cpp]

The issue-14 check (Llama-3.2-1B's shape: hidden 2048, 16 layers, 32/8 heads, ffn 8192, vocab
128,256, tied Q8_0 embedding, Q4_1 matrices; random weights, SmolLM2's tokenizer padded):

    python benchmarks/memory.py --synthetic llama-1b --runs 3

``--synthetic PRESET`` writes the file once with benchmarks/synthetic_gguf.py to
~/.cache/memwall/synthetic/PRESET-v<vocab>-q4_1.gguf (~6 s, 850 MiB) and reuses it after.

Each engine runs in its own subprocess, pinned to the same cores, and serves one request: a
``--prompt-tokens`` prompt (random common words, counted with the model's tokenizer) and
``--decode-tokens`` greedy tokens, with a KV cache for ``--ctx`` tokens:

    memwall     LLM(num_kv_blocks=ctx/16, block_size=16, max_model_len=ctx), one generate()
    llama.cpp   llama-server -c ctx -np 1 -t threads, one POST /completion

Peak RSS is the kernel's high-water mark (VmHWM in /proc/PID/status: anonymous memory plus the
pages of the mmapped GGUF that were touched), read by memwall's worker itself after the request
and, for llama-server, read by this script after its response. ``--runs`` repeats each engine
and keeps the run with the median peak (every run's peak is kept in ``all_peaks_mb``).
memwall's worker also reports its resident size after each stage (import, load, generate) and
its high-water mark up to each. Writes benchmarks/results/memory-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import synthetic_gguf  # noqa: E402
from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402
from benchmarks.servers import (ManagedServer, embedded_gguf, find_llama_bin_dir,  # noqa: E402
                                free_port, llama_command, pin_prefix)

BLOCK = 16


def proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS / VmHWM / RssAnon / RssFile of a process, and AnonHugePages (anonymous memory in
    transparent huge pages: a region madvised MADV_HUGEPAGE, as numpy does for its large
    arrays, may be made resident 2 MB at a time by khugepaged, untouched pages included), in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            out["AnonHugePages"] = int(line.split()[1]) / 1024
    return out


# ---- memwall (runs in a subprocess) --------------------------------------------------------------
def worker_memwall(spec: dict) -> dict:
    stages, peaks = {}, {}

    def stage(name: str) -> None:
        status = proc_status()
        stages[name], peaks[name] = status["VmRSS"], status["VmHWM"]

    stage("start")
    from memwall import LLM, SamplingParams

    stage("import")
    start = time.perf_counter()
    llm = LLM(spec["model"], threads=spec["threads"], block_size=BLOCK,
              num_kv_blocks=spec["ctx"] // BLOCK, max_model_len=spec["ctx"],
              quantization=spec["quantization"], **spec.get("engine_args", {}))
    load_s = time.perf_counter() - start
    stage("load")
    params = SamplingParams(temperature=0, max_tokens=spec["decode_tokens"], ignore_eos=True)
    out = llm.generate([spec["prompt"]], params)[0]
    stage("generate")
    status = proc_status()
    return {"peak_rss_mb": status["VmHWM"], "rss_mb": status["VmRSS"], **kv_allocation(llm),
            "rss_anon_mb": status["RssAnon"], "rss_file_mb": status["RssFile"],
            "anon_huge_mb": status.get("AnonHugePages"),
            "rss_after_mb": stages, "peak_after_mb": peaks, "load_s": load_s,
            "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(out.outputs[0].token_ids)}


def kv_allocation(llm) -> dict:
    """What the engine allocated for its KV cache (every layer's K and V, int8's scales too), and
    per token of it; {} where the worker is in another process. The step budget it chose too."""
    from memwall.attention import kv_quant

    core = llm.engine.core
    try:
        caches = core.executor.worker.runner.kv_caches
    except AttributeError:
        return {}
    total = sum(t.numel() * t.element_size() + (0 if kv_quant.scales_of(t) is None else
                                                kv_quant.scales_of(t).numel() * 4)
                for pair in caches for t in pair)
    tokens = core.kv.pool.num_blocks * core.kv.block_size if hasattr(core, "kv") else 0
    return {"kv_cache_bytes": total, "kv_bytes_per_token": total / tokens if tokens else None,
            "step_budget": core.scheduler.config.max_num_batched_tokens}


def run_memwall(args: argparse.Namespace, prompt: str) -> dict:
    spec = {"model": args.model, "threads": args.threads, "ctx": args.ctx, "prompt": prompt,
            "decode_tokens": args.decode_tokens, "quantization": args.quantization,
            "engine_args": getattr(args, "engine_args", {})}
    cmd = pin_prefix(args.threads) + [sys.executable, __file__, "--worker", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- llama.cpp -----------------------------------------------------------------------------------
def run_llama(args: argparse.Namespace, prompt: str) -> dict:
    import httpx

    port = free_port()
    command = llama_command(find_llama_bin_dir(args.llama_bin_dir), args.model, port,
                            args.threads, parallel=1, ctx_per_slot=args.ctx)
    with ManagedServer(command, port) as server:
        pid = server.process.pid  # taskset execs the server: same pid
        loaded = proc_status(pid)
        body = {"prompt": prompt, "n_predict": args.decode_tokens, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False}
        reply = httpx.post(f"{server.base_url}/completion", json=body, timeout=600,
                           trust_env=False).json()
        status = proc_status(pid)
    timings = reply.get("timings", {})
    return {"peak_rss_mb": status["VmHWM"], "rss_mb": status["VmRSS"],
            "rss_anon_mb": status["RssAnon"], "rss_file_mb": status["RssFile"],
            "anon_huge_mb": status.get("AnonHugePages"),
            "rss_after_mb": {"load": loaded["VmRSS"], "generate": status["VmRSS"]},
            "prompt_tokens": timings.get("prompt_n"), "output_tokens": timings.get("predicted_n"),
            "argv": command.argv}


# ---- driver --------------------------------------------------------------------------------------
def make_prompt(model: str, tokens: int) -> str:
    import random

    from benchmarks.datasets import GGUFTokenizer, random_prompt

    return random_prompt(GGUFTokenizer(model), tokens, random.Random(0))


def median_of(runs: list[dict]) -> dict:
    """The run with the median peak (the lower middle one of an even count)."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["peak_rss_mb"])
    if not ok:
        return runs[-1]
    median = dict(ok[(len(ok) - 1) // 2])
    median["all_peaks_mb"] = [round(r["peak_rss_mb"], 1) for r in ok]
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--synthetic", choices=sorted(synthetic_gguf.PRESETS), default=None,
                        help="a synthetic GGUF of this shape (benchmarks/synthetic_gguf.py), "
                             "written once to ~/.cache/memwall/synthetic/")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096, help="context the KV cache holds")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="runs per engine; the median peak is kept")
    parser.add_argument("--engines", default="memwall,llama.cpp")
    parser.add_argument("--quantization", default="auto", help="memwall's --quantization")
    parser.add_argument("--llama-bin-dir", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker_memwall(json.loads(args.worker))))
        return
    if args.ctx % BLOCK:
        parser.error(f"--ctx {args.ctx} must be a multiple of the block size {BLOCK}")
    if args.model and args.synthetic:
        parser.error("give --model or --synthetic, not both")
    if args.synthetic:
        args.model = str(synthetic_gguf.cached(args.synthetic))
    args.model = str(args.model or embedded_gguf())
    prompt = make_prompt(args.model, args.prompt_tokens)
    runners = {"memwall": run_memwall, "llama.cpp": run_llama}
    results = {}
    for engine in args.engines.split(","):
        results[engine] = median_of([runners[engine](args, prompt) for _ in range(args.runs)])
    report = {"benchmark": "memory", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpu": cpu_model(), "model": args.model, "threads": args.threads, "ctx": args.ctx,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "runs": args.runs, "results": results}
    mw, lc = results.get("memwall", {}), results.get("llama.cpp", {})
    if mw.get("peak_rss_mb") and lc.get("peak_rss_mb"):
        report["ratio_peak_rss"] = mw["peak_rss_mb"] / lc["peak_rss_mb"]
    print_table(report)
    path = write_result("memory", report)
    print(f"wrote {path.relative_to(ROOT)}")


def print_table(report: dict) -> None:
    print(f"{report['cpu']}, {report['threads']} threads, ctx {report['ctx']}, "
          f"{report['prompt_tokens']} prompt + {report['decode_tokens']} decode tokens, "
          f"median of {report['runs']}")
    print(f"{'engine':<11}{'peak RSS MB':>12}{'final RSS MB':>13}{'anon MB':>9}{'file MB':>9}"
          f"{'THP MB':>8}{'tokens in/out':>15}")
    for name, r in report["results"].items():
        if "error" in r:
            print(f"{name:<11}  error: {r['error']}")
            continue
        tokens = f"{r['prompt_tokens']}/{r['output_tokens']}"
        print(f"{name:<11}{r['peak_rss_mb']:>12.0f}{r['rss_mb']:>13.0f}{r['rss_anon_mb']:>9.0f}"
              f"{r['rss_file_mb']:>9.0f}{r.get('anon_huge_mb') or 0:>8.0f}{tokens:>15}")
    memwall = report["results"].get("memwall", {})
    for key, what in (("rss_after_mb", "RSS"), ("peak_after_mb", "peak RSS")):
        if memwall.get(key):
            print(f"memwall {what} after: " +
                  ", ".join(f"{k} {v:.0f}" for k, v in memwall[key].items()) + " MB")
    if "ratio_peak_rss" in report:
        print(f"peak RSS memwall / llama.cpp: {report['ratio_peak_rss']:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
