"""CPU benchmark: memwall vs HF transformers vs llama.cpp on one GGUF, one run.

    python benchmarks/cpu.py [--model GGUF] [--threads 2] [--decode-tokens 128] [--prompt-tokens 512]
                             [--batch-requests 16] [--engines memwall,transformers,llama.cpp]
                             [--rounds 3]

Each engine runs in its own subprocess (so its peak RSS is its own), pinned to the same cores
with the same thread count. Reported: B=1 decode tokens/s, prefill tokens/s for a
``--prompt-tokens`` prompt, batch throughput (output tokens/s for ``--batch-requests``
requests: memwall serves them together, transformers runs generate() for one after another),
peak RSS. The engines run --rounds times, interleaved; the table shows each figure's median
and the ratios memwall / baseline of each round (measured minutes apart at most) with their
median. Writes JSON to benchmarks/results/cpu-<time>.json
with the CPU model. llama.cpp comes from scripts/setup-baselines (skipped with a note if it is
not built); its concurrent serving is compared by benchmarks/serve.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import ROOT, write_result  # noqa: E402

LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", Path.home() / ".cache/memwall-baselines/llama.cpp/bin"))


def cpu_model() -> str:
    from memwall.planner.hardware import cpu_name

    return cpu_name()


# ---- workers (run in a subprocess) -----------------------------------------------------------
def worker_memwall(model: str, threads: int, decode_tokens: int, prompt_tokens: int, extra: dict) -> dict:
    from memwall import LLM, SamplingParams

    extra = dict(extra)
    batch = extra.pop("batch", None)
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
    result = {"prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": decode_tokens / decode_s,
              "step_budget": engine.core.scheduler.config.max_num_batched_tokens}
    if batch:  # throughput: all requests at once, continuous batching
        prompts = _batch_prompts(llm.tokenizer, batch["requests"], batch["prompt_tokens"])
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=batch["output_tokens"])
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(batch_tok_s=produced / elapsed, batch_requests=len(prompts))
    return result


def _batch_prompts(tokenizer, requests: int, tokens: int) -> list[list[int]]:
    """Distinct prompts of ``tokens`` tokens (no shared prefix to cache)."""
    base = _prompt_ids(tokenizer, tokens + requests)
    return [base[i:i + tokens] for i in range(requests)]


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
        result = {"prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": decode_tokens / decode_s}
        batch = extra.get("batch")
        if batch:  # throughput of sequential generate(): one request after another
            count = min(batch["requests"], batch["hf_requests"])
            prompts = _batch_prompts(Tokenizer.from_gguf(open_gguf(path)), batch["requests"],
                                     batch["prompt_tokens"])[:count]
            out = batch["output_tokens"]
            start = time.perf_counter()
            for prompt in prompts:
                hf.generate(torch.tensor([prompt]), max_new_tokens=out, min_new_tokens=out,
                            do_sample=False)
            result.update(batch_tok_s=count * out / (time.perf_counter() - start),
                          batch_requests=count)
    return result


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
    parser.add_argument("--batch-requests", type=int, default=16,
                        help="throughput run: this many requests (0 to skip); memwall serves them "
                             "together, transformers one generate() after another")
    parser.add_argument("--batch-prompt-tokens", type=int, default=128)
    parser.add_argument("--batch-output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-requests", type=int, default=4,
                        help="transformers' sequential run times this many of the requests "
                             "(its throughput does not depend on how many)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the engines this many times, interleaved (A B A B ...), and "
                             "report each figure's median: a VM's speed drifts by 10-30%% over "
                             "minutes, so one run of each engine at different times misleads")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker)
    if args.model is None:
        from memwall.loader.model_loader import embedded_model_path

        args.model = str(embedded_model_path())
    batch = {"requests": args.batch_requests, "prompt_tokens": args.batch_prompt_tokens,
             "output_tokens": args.batch_output_tokens, "hf_requests": args.hf_batch_requests}
    engines = args.engines.split(",")
    rounds: list[dict] = []
    for i in range(max(1, args.rounds)):
        per_engine = {}
        for engine in engines:
            print(f"round {i + 1}/{args.rounds}: running {engine} ...", file=sys.stderr, flush=True)
            extra = {"batch": batch} if args.batch_requests else {}
            per_engine[engine] = (run_llama_cpp(args) if engine == "llama.cpp"
                                  else run_worker(engine, args, extra))
        rounds.append(per_engine)
    report = {"cpu": cpu_model(), "threads": args.threads, "model": Path(args.model).name,
              "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens,
              "batch": batch, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "results": {e: median_result([r[e] for r in rounds]) for e in engines},
              "round_ratios": round_ratios(rounds), "rounds": rounds}
    print_table(report)
    out = write_result("cpu", report)
    print(f"\nwrote {out.relative_to(ROOT)}")


METRICS = ("decode_tok_s", "prefill_tok_s", "batch_tok_s", "peak_rss_mb")


def median_result(runs: list[dict]) -> dict:
    """Each metric's median over the rounds that measured it (an error only if all failed)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = {}
    for key in {k for r in ok for k in r}:
        values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
        out[key] = statistics.median(values) if values else ok[0].get(key)
    return out


def round_ratios(rounds: list[dict]) -> dict:
    """memwall / each baseline, per round (both measured minutes apart at most) and their
    median: the figure to quote."""
    out = {}
    for base in {e for r in rounds for e in r if e != "memwall"}:
        per_key = {}
        for key in METRICS[:3]:
            values = [r["memwall"][key] / r[base][key] for r in rounds
                      if "memwall" in r and base in r and r["memwall"].get(key) and r[base].get(key)]
            if values:
                per_key[key] = {"per_round": values, "median": statistics.median(values)}
        out[base] = per_key
    return out


def print_table(report: dict) -> None:
    results = report["results"]
    batch = report.get("batch") or {}
    print(f"\nCPU: {report['cpu']}, {report['threads']} threads, model {report['model']}")
    print(f"batch tok/s: output tokens/s over {batch.get('requests')} requests of "
          f"{batch.get('prompt_tokens')} prompt + {batch.get('output_tokens')} output tokens "
          "(memwall: all at once; transformers: sequential generate)")
    header = (f"{'engine':<14}{'decode tok/s':>14}{'prefill tok/s':>15}{'batch tok/s':>13}"
              f"{'peak RSS MB':>13}")
    print(header + "\n" + "-" * len(header))
    fmt = lambda v, spec: format(v, spec) if v else "n/a"
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<14}  error: {r['error']}")
            continue
        print(f"{name:<14}{fmt(r.get('decode_tok_s'), '.1f'):>14}{fmt(r.get('prefill_tok_s'), '.1f'):>15}"
              f"{fmt(r.get('batch_tok_s'), '.1f'):>13}{fmt(r.get('peak_rss_mb'), '.0f'):>13}")
    ours = results.get("memwall", {})
    for base in [n for n in results if n != "memwall"]:
        r = results[base]
        if "error" in r or "error" in ours:
            continue
        parts = [f"{label} {ours[key] / r[key]:.2f}x" for key, label in
                 (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill"),
                  ("batch_tok_s", "batch throughput"), ("peak_rss_mb", "RSS"))
                 if r.get(key) and ours.get(key)]
        print(f"memwall / {base} (medians): " + ", ".join(parts))
    for base, per_key in (report.get("round_ratios") or {}).items():
        if per_key:
            print(f"memwall / {base}, round by round: " + "; ".join(
                f"{key.removesuffix('_tok_s')} " + " ".join(f"{v:.2f}x" for v in r["per_round"])
                + f" (median {r['median']:.2f}x)" for key, r in per_key.items()))


if __name__ == "__main__":
    main()
