"""The live dashboard's cost to the engine: step time with the page closed and open, one run.

    python benchmarks/dashboard.py [--model GGUF] [--threads 1] [--requests 8] [--max-tokens 32]
                                   [--rounds 3] [--no-browser]

One `memwall serve` (the embedded model by default). Each round runs the same workload (as many
streaming completions at once as --requests, greedy, ignore_eos) once per setting, interleaved
so that a busy shared host drifts the same for all:

    closed    nobody watches (the baseline)
    stream    one client reads /dashboard/api/events: all the server does for an open page
    browser   headless Chromium (/usr/bin/chromium) with /dashboard open, free to run on any
              core: adds the browser's own CPU, which on a small host competes with the engine
    browser-apart   the same, the browser kept off the server's cores (when there are others):
              a page watched from another machine, as far as this host can show it

Step times are the engine core's own records (what the timeline shows), read after each run
from the first event of a fresh stream. Also measured in process, without a model: what the
core adds per step (record_step and pickling its record) and what one block map costs to build
(at most 4 a second) for caches of 512 to 131072 blocks. Writes
benchmarks/results/dashboard-<time>.json with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import write_result  # noqa: E402
from benchmarks.servers import (HOST, ManagedServer, ServerCommand, embedded_gguf,  # noqa: E402
                                free_port, pin_prefix)

KEY = "bench"
REPO = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


# ---- the served workload -------------------------------------------------------------------
def run_workload(url: str, requests: int, max_tokens: int) -> float:
    """Fires the requests at once and waits for all of them; returns the wall seconds."""
    def one(i: int) -> None:
        body = {"prompt": f"Request {i}: tell me a story about the sea.", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def last_step(url: str) -> int:
    return httpx.get(f"{url}/dashboard/api/snapshot", params={"key": KEY}, timeout=10).json()["last_step"]


def steps_after(url: str, index: int) -> list[dict]:
    """The engine's step records after ``index`` (a fresh stream's first event has them all)."""
    with httpx.stream("GET", f"{url}/dashboard/api/events", params={"key": KEY}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return [s for s in json.loads(line[6:])["steps"] if s["i"] > index]
    return []


class StreamReader:
    """One dashboard event stream read in a thread (what a page costs the server)."""

    def __enter__(self):
        self.stop, self.events = threading.Event(), 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/api/events", params={"key": KEY},
                          timeout=60) as r:
            for line in r.iter_lines():
                self.events += line.startswith("data: ")
                if self.stop.is_set():
                    return

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


class Browser:
    """Headless Chromium with the page open (on ``cpus`` when given: its processes inherit the
    affinity chromedriver is started with)."""

    cpus: set[int] | None = None

    def __enter__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--window-size=1500,1400"):
            options.add_argument(arg)
        mine = os.sched_getaffinity(0)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        try:
            self.driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        finally:
            os.sched_setaffinity(0, mine)
        self.driver.get(f"{self.url}/dashboard?key={KEY}")
        time.sleep(1.0)  # connected, first event drawn
        return self

    def __exit__(self, *exc) -> None:
        self.driver.quit()


class BrowserApart(Browser):
    pass


def measure(url: str, setting: str, args) -> dict:
    watcher = {"stream": StreamReader, "browser": Browser, "browser-apart": BrowserApart}.get(setting)
    before = last_step(url)
    if watcher is None:
        wall = run_workload(url, args.requests, args.max_tokens)
    else:
        watcher.url = url
        with watcher():
            wall = run_workload(url, args.requests, args.max_tokens)
    ms = [s["ms"] for s in steps_after(url, before)]
    return {"setting": setting, "wall_s": wall, "steps": len(ms), "step_ms": ms,
            "tok_s": args.requests * args.max_tokens / wall}


def summary(runs: list[dict]) -> dict:
    ms = sorted(m for r in runs for m in r["step_ms"])
    return {"runs": len(runs), "steps": len(ms), "step_ms_median": statistics.median(ms),
            "step_ms_mean": statistics.fmean(ms), "step_ms_p90": ms[int(0.9 * (len(ms) - 1))],
            "tok_s_median": statistics.median(r["tok_s"] for r in runs)}


# ---- the core's own per-step cost, in process ------------------------------------------------
def micro() -> dict:
    from memwall.config import SchedulerConfig
    from memwall.core.kv.manager import KVCacheManager
    from memwall.core.live_view import build_view
    from memwall.core.scheduler import Scheduler
    from memwall.core.step import RunnerOutput, SampledToken, SchedulerOutput
    from memwall.core.step_record import record_step
    from memwall.request import Request
    from memwall.sampling_params import SamplingParams

    out = {}
    for batch in (8, 64):
        requests = {f"cmpl-{i:032x}": Request(f"cmpl-{i:032x}", list(range(100)), SamplingParams(),
                                              64, output_token_ids=[1] * 10,
                                              num_computed_tokens=109) for i in range(batch)}
        sched = SchedulerOutput(num_scheduled_tokens={rid: 1 for rid in requests})
        result = RunnerOutput(sampled={rid: SampledToken(5) for rid in requests})
        n = 2000
        start = time.perf_counter()
        for i in range(n):
            record = record_step(i, 0.0, sched, result, requests)
        record_us = (time.perf_counter() - start) / n * 1e6
        start = time.perf_counter()
        for _ in range(n):
            blob = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        pickle_us = (time.perf_counter() - start) / n * 1e6
        out[f"record_step_b{batch}"] = {"record_us": record_us, "pickle_us": pickle_us,
                                        "bytes": len(blob)}
    for blocks in (512, 16384, 131072):
        kv = KVCacheManager(blocks, 16)
        scheduler = Scheduler(SchedulerConfig(), kv)
        for i in range(64):  # 64 requests holding half the cache
            rid = f"cmpl-{i:032x}"
            kv.block_tables[rid] = kv.pool.allocate(blocks // 128)
            scheduler.running.append(Request(rid, [1] * 100, SamplingParams(), 16))
        n = max(3, 20000 // blocks)
        start = time.perf_counter()
        for _ in range(n):
            view = build_view(scheduler)
        build_ms = (time.perf_counter() - start) / n * 1000
        out[f"block_map_{blocks}"] = {"build_ms": build_ms,
                                      "pickle_bytes": len(pickle.dumps(view)),
                                      "share_of_a_second_at_4hz": 4 * build_ms / 1000}
    return out


def serve_command(model: Path, port: int, args) -> ServerCommand:
    """This checkout's `memwall serve` (run as a module from the repository root, so that the
    code measured is the code here), pinned to its --threads cores."""
    argv = [sys.executable, "-m", "memwall.entrypoints.cli", "serve", str(model), "--host", HOST,
            "--port", str(port), "--threads", str(args.threads), "--max-num-seqs",
            str(args.requests), "--api-key", KEY, "--max-model-len", "1024", "--no-show-progress"]
    return ServerCommand("memwall", pin_prefix(args.threads) + argv,
                         env={"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    settings = ["closed", "stream"]
    if not args.no_browser and CHROMIUM.exists() and CHROMEDRIVER.exists():
        settings.append("browser")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > args.threads:  # the server is pinned to the first --threads of them
            BrowserApart.cpus = set(cpus[args.threads:])
            settings.append("browser-apart")
    model = args.model or embedded_gguf()
    port = free_port()
    runs: list[dict] = []
    with ManagedServer(serve_command(model, port, args), port) as server:
        run_workload(server.base_url, args.requests, 4)  # warm up (first-use kernels)
        for round_ in range(args.rounds):
            for setting in settings:
                runs.append({"round": round_, **measure(server.base_url, setting, args)})
                print(f"round {round_} {setting:14s} {statistics.median(runs[-1]['step_ms']):8.2f} "
                      f"ms/step median, {runs[-1]['tok_s']:6.1f} tok/s", flush=True)
    results = {s: summary([r for r in runs if r["setting"] == s]) for s in settings}
    costs = micro()
    print(f"\nCPU: {cpu_model()}, memwall serve --threads {args.threads}, {args.requests} "
          f"requests x {args.max_tokens} tokens, {args.rounds} rounds")
    print(f"{'setting':14s} {'median ms':>10s} {'mean ms':>9s} {'p90 ms':>8s} {'tok/s':>7s} "
          f"{'vs closed':>10s}")
    base = results["closed"]["step_ms_median"]
    for s, r in results.items():
        print(f"{s:14s} {r['step_ms_median']:10.2f} {r['step_ms_mean']:9.2f} "
              f"{r['step_ms_p90']:8.2f} {r['tok_s_median']:7.1f} {r['step_ms_median'] / base:9.2f}x")
    print("\nper step in the core:", ", ".join(
        f"{k}: {v['record_us']:.1f} us + pickle {v['pickle_us']:.1f} us ({v['bytes']} B)"
        for k, v in costs.items() if k.startswith("record")))
    print("block map (<= 4/s):", ", ".join(
        f"{k.split('_')[-1]} blocks {v['build_ms']:.2f} ms" for k, v in costs.items()
        if k.startswith("block_map")))
    path = write_result("dashboard", {"cpu": cpu_model(), "args": vars(args), "model": Path(model).name,
                                      "summary": results, "runs": runs, "core_costs": costs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
