"""CPU single-stream benchmark: memwall vs HF transformers vs llama.cpp on one GGUF, one run.

    python benchmarks/cpu.py [--model GGUF] [--threads 2] [--decode-tokens 128] [--prompt-tokens 512]

Each engine runs in its own subprocess (so its peak RSS is its own), pinned to the same cores
with the same thread count. Reported: B=1 decode tokens/s, prefill tokens/s for a
``--prompt-tokens`` prompt, peak RSS. Ratios are memwall / baseline. Writes JSON to
benchmarks/results/cpu-<time>.json with the CPU model. llama.cpp comes from
scripts/setup-baselines (skipped with a note if it is not built).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", Path.home() / ".cache/memwall-baselines/llama.cpp/bin"))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---- workers (run in a subprocess) -----------------------------------------------------------
def worker_memwall(model: str, threads: int, decode_tokens: int, prompt_tokens: int, extra: dict) -> dict:
    from memwall import LLM, SamplingParams

    llm = LLM(model, threads=threads, max_model_len=2048, kv_cache_memory=256 << 20,
              prefix_caching=False, **extra)
    engine = llm.engine
    prompt = _prompt_ids(llm.tokenizer, prompt_tokens)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    llm.generate([prompt[:32]], greedy)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], greedy)
    prefill_s = time.perf_counter() - start
    # Decode: time steps after the first token of a short prompt.
    engine.add_request("decode", prompt[:16], SamplingParams(temperature=0, ignore_eos=True,
                                                             max_tokens=decode_tokens + 1))
    engine.step()  # prefill + first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": decode_tokens / decode_s}


def worker_transformers(model: str, threads: int, decode_tokens: int, prompt_tokens: int, extra: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    path = Path(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           torch_dtype=torch.float32).eval()
    from memwall.loader.gguf_loader import open_gguf
    from memwall.tokenizer.tokenizer import Tokenizer

    prompt = _prompt_ids(Tokenizer.from_gguf(open_gguf(path)), prompt_tokens)
    with torch.no_grad():
        hf.generate(torch.tensor([prompt[:32]]), max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        hf(torch.tensor([prompt]))
        prefill_s = time.perf_counter() - start
        ids = torch.tensor([prompt[:16]])
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1,
                    do_sample=False)
        decode_s = time.perf_counter() - start - first_s
    return {"prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": decode_tokens / decode_s}


def _prompt_ids(tokenizer, count: int) -> list[int]:
    text = " ".join(f"The memory wall limits token {i} of every large language model." for i in range(count))
    return tokenizer.encode(text, add_special_tokens=False)[:count]


WORKERS = {"memwall": worker_memwall, "transformers": worker_transformers}


def run_worker(name: str, args: argparse.Namespace, extra: dict | None = None) -> dict:
    """Runs one engine in a pinned subprocess; adds its peak RSS."""
    payload = json.dumps({"name": name, "model": args.model, "threads": args.threads,
                          "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens,
                          "extra": extra or {}})
    cmd = _pinned(args.threads) + [sys.executable, __file__, "--worker", payload]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(payload: str) -> None:
    spec = json.loads(payload)
    result = WORKERS[spec["name"]](spec["model"], spec["threads"], spec["decode_tokens"],
                                   spec["prompt_tokens"], spec["extra"])
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def run_llama_cpp(args: argparse.Namespace) -> dict:
    bench = LLAMA_BIN / "llama-bench"
    if not bench.exists():
        return {"error": f"llama-bench not found in {LLAMA_BIN}: run scripts/setup-baselines"}
    cmd = _pinned(args.threads) + [str(bench), "-m", args.model, "-t", str(args.threads),
                                   "-p", str(args.prompt_tokens), "-n", str(args.decode_tokens),
                                   "-r", "3", "-o", "json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-300:]}
    rows = json.loads(proc.stdout)
    result = {}
    for row in rows:
        key = "prefill_tok_s" if row.get("n_prompt", 0) > 0 else "decode_tok_s"
        result[key] = row["avg_ts"]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all children so far; llama-bench runs after the
    # Python workers, so only trust it when it grew.
    result["peak_rss_mb"] = rss / 1024 if rss > before else None
    return result


def _pinned(threads: int) -> list[str]:
    if shutil.which("taskset") and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))[:threads]
        return ["taskset", "-c", ",".join(map(str, cores))]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--engines", default="memwall,transformers,llama.cpp")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)
    if args.model is None:
        from memwall.loader.model_loader import embedded_model_path

        args.model = str(embedded_model_path())
    results = {}
    for engine in args.engines.split(","):
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        results[engine] = run_llama_cpp(args) if engine == "llama.cpp" else run_worker(engine, args)
    report = {"cpu": cpu_model(), "threads": args.threads, "model": Path(args.model).name,
              "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results}
    print_table(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out.relative_to(ROOT)}")


def print_table(report: dict) -> None:
    results = report["results"]
    print(f"\nCPU: {report['cpu']}, {report['threads']} threads, model {report['model']}")
    header = f"{'engine':<14}{'decode tok/s':>14}{'prefill tok/s':>15}{'peak RSS MB':>13}"
    print(header + "\n" + "-" * len(header))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}  error: {r['error']}")
            continue
        rss = r.get("peak_rss_mb")
        print(f"{name:<14}{r['decode_tok_s']:>14.1f}{r['prefill_tok_s']:>15.1f}"
              f"{(f'{rss:.0f}' if rss else 'n/a'):>13}")
    ours = results.get("memwall", {})
    for base in [n for n in results if n != "memwall"]:
        r = results[base]
        if "error" in r or "error" in ours:
            continue
        ratio = lambda k: ours[k] / r[k] if r.get(k) else float("nan")
        print(f"memwall / {base}: decode {ratio('decode_tok_s'):.2f}x, prefill {ratio('prefill_tok_s'):.2f}x"
              + (f", RSS {ours['peak_rss_mb'] / r['peak_rss_mb']:.2f}x" if r.get("peak_rss_mb") else ""))


if __name__ == "__main__":
    main()
