"""What prompt lookup can gain at batch 1 on this CPU, and its ceiling (issue 15).

    python benchmarks/lookup_bound.py [--model GGUF] [--threads 2] [--max-tokens 128]
                                      [--grounded 24] [--chat 20] [--max-k 8]
                                      [--step-costs 4] [--cost-ks 1,2,3,4,6,8]

Greedy speculation reproduces the plain greedy output token for token, so what any
prompt-lookup policy would accept is fixed once that output is known. This benchmark decodes
``spec_decode.py``'s prompts plainly, then replays policies over the outputs (the engine's own
``NgramProposer``): at each step the policy drafts from the prompt and the output so far, the
drafts are checked against the real next tokens, and the step advances by the accepted ones
plus one, as verification does. A step of d drafts costs what a batch-1 step of 1 + d rows
measured here in the same run, relative to a one-row step: for each k of ``--cost-ks`` an
engine drafting k tokens at every match (the adaptive policy off) is timed around its executor
(forward, sampling, verification, the lookups; ``spec_decode.step_costs``), other counts
interpolated. Columns:

- ``tok/step``: tokens a decode step yields (plain decoding: 1); with free verification this
  is the speedup's ceiling;
- ``drafted``: the share of steps that had a lookup match to draft from;
- ``at this CPU``: tokens / (the steps' measured cost), the decode phase's speedup the policy
  would reach where a step costs what its executor call does (the scheduler, detokenizer and
  outputs, the same with or without drafts, left out).

Besides fixed policies (``k`` drafts from the longest suffix match of ``min`` to 4 tokens), two
ideals no real drafter reaches: ``best k``, each step drafting exactly the tokens that will
be accepted from the engine's match (no rejected rows), and ``best copy``, each step copying
the longest run that any earlier occurrence of the last token begins (a drafter that always
knew which occurrence to follow and how far; up to ``--max-k`` tokens).

Writes benchmarks/results/lookup_bound-<time>.json with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402

Drafter = Callable[[np.ndarray, list[int]], list[int]]
"""(context, the rest of the real output) -> drafts. Realistic drafters ignore the second."""


@dataclass
class Replay:
    policy: str
    tokens: int  # decode-phase tokens (after the first)
    steps: int
    drafted_steps: int
    draft_rows: list[int]  # steps by their number of drafts (index = drafts)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 1.0

    def speedup(self, row_cost: Callable[[int], float]) -> float:
        """Decode-phase speedup when a step of d drafts costs row_cost(d) plain steps."""
        cost = sum(n * row_cost(d) for d, n in enumerate(self.draft_rows))
        return self.tokens / cost if cost else 1.0


def agreeing(drafts: Sequence[int], rest: Sequence[int]) -> int:
    """How many of the drafts verification accepts: their prefix equal to the real output."""
    n = 0
    while n < len(drafts) and n < len(rest) and drafts[n] == rest[n]:
        n += 1
    return n


def replay(policy: str, drafter: Drafter, outputs: Sequence[tuple[list[int], list[int]]]) -> Replay:
    """Steps of speculative greedy decoding over known (prompt, output) pairs: each step
    drafts, accepts the drafts' prefix that equals the real output, and yields that plus one
    token. The first output token comes from prefill, not a decode step."""
    tokens = steps = drafted = 0
    rows: list[int] = []
    for prompt, output in outputs:
        context = list(prompt) + list(output[:1])
        t = 1
        while t < len(output):
            rest = output[t:]
            drafts = drafter(np.asarray(context, dtype=np.int64), rest)[:len(rest) - 1]
            accepted = agreeing(drafts, rest)
            context.extend(rest[:accepted + 1])
            t += accepted + 1
            tokens, steps, drafted = tokens + accepted + 1, steps + 1, drafted + bool(drafts)
            rows.extend([0] * (len(drafts) + 1 - len(rows)))
            rows[len(drafts)] += 1
    return Replay(policy, tokens, steps, drafted, rows)


def lookup_drafter(min_n: int, max_n: int, k: int) -> Drafter:
    from memwall.spec_decode.ngram import NgramProposer

    proposer = NgramProposer(min_n, max_n)
    return lambda context, rest: proposer.lookup(context, k)


def exact_lookup_drafter(min_n: int, max_n: int, k: int) -> Drafter:
    """The engine's match, drafting only the tokens that will be accepted (none rejected)."""
    lookup = lookup_drafter(min_n, max_n, k)

    def draft(context: np.ndarray, rest: list[int]) -> list[int]:
        drafts = lookup(context, rest)
        return drafts[:agreeing(drafts, rest)]

    return draft


def best_copy_drafter(k: int) -> Drafter:
    """The longest run (up to k) that follows any earlier occurrence of the last token and
    equals the real continuation."""
    def draft(context: np.ndarray, rest: list[int]) -> list[int]:
        starts = np.flatnonzero(context[:-1] == context[-1]) + 1
        want = np.asarray(rest[:k], dtype=np.int64)
        best = 0
        for s in starts:
            run = context[s:s + len(want)]
            same = run == want[:len(run)]
            n = int(same.argmin()) if not same.all() else len(run)
            best = max(best, n)
        return list(want[:best])

    return draft


def row_cost_from(step_ms: dict[int, float]) -> Callable[[int], float]:
    """A step of d drafts (1 + d rows) in plain one-row steps, as the engine's adaptive policy
    reads a step table (``StepCost``: linear between the measured row counts, the last slope
    past them, made monotone)."""
    from memwall.spec_decode.adaptive import StepCost

    if 1 not in step_ms or len(step_ms) < 2:
        raise ValueError("need the one-row step and at least one verify size, got "
                         f"{sorted(step_ms)}")
    table = StepCost(step_ms)
    return lambda drafts: table(1 + drafts) / table(1)


def measured_step_ms(args, prompts: list[str]) -> dict[int, float]:
    """Milliseconds of a batch-1 step by rows: for each k of ``--cost-ks``, an engine drafting
    k tokens at every lookup match (adaptive policy off) times its steps over the prompts. Each
    engine's verify steps count relative to its own one-row steps (the VM's speed drifts
    between engines), at the median of all engines' one-row figure."""
    import statistics

    from benchmarks.spec_decode import make_llm, step_costs

    ones, ratios = [], {}
    for k in sorted({int(k) for k in args.cost_ks.split(",")}):
        spec = make_llm(args.model, args.threads, json.dumps(
            {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}), 1)
        costs = step_costs(spec, prompts, args.max_tokens)
        del spec
        if 1 in costs and k + 1 in costs:
            ones.append(costs[1])
            ratios[k + 1] = costs[k + 1] / costs[1]
    if not ones:
        return {}
    one = statistics.median(ones)
    return {1: one, **{rows: one * ratio for rows, ratio in sorted(ratios.items())}}


def policies(max_k: int) -> list[tuple[str, Drafter]]:
    out = []
    for min_n in (2, 1):
        for k in sorted({1, 2, 3, 4, 6, max_k}):
            if k <= max_k:
                out.append((f"k={k}, match {min_n}-4", lookup_drafter(min_n, 4, k)))
    out.append((f"best k <= {max_k}, match 2-4", exact_lookup_drafter(2, 4, max_k)))
    out.append((f"best k <= {max_k}, match 1-4", exact_lookup_drafter(1, 4, max_k)))
    out.append((f"best copy <= {max_k}", best_copy_drafter(max_k)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--grounded", type=int, default=24)
    parser.add_argument("--chat", type=int, default=20)
    parser.add_argument("--step-costs", type=int, default=4, metavar="N",
                        help="grounded prompts to time batch-1 steps by rows over, for each k")
    parser.add_argument("--cost-ks", default="1,2,3,4,6,8",
                        help="the draft counts whose verify steps are timed (others interpolated)")
    parser.add_argument("--max-k", type=int, default=8)
    args = parser.parse_args()
    from benchmarks.spec_decode import chat_prompts, grounded_prompts, make_llm, one_at_a_time

    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    plain = make_llm(args.model, args.threads, None, 1)
    workloads = {"grounded": grounded_prompts(args.grounded), "chat": chat_prompts(args.chat)}
    outputs = {}
    for name, prompts in workloads.items():
        if prompts:
            ran = one_at_a_time({"plain": plain}, prompts, args.max_tokens)["plain"]
            ids = [plain.render_chat([{"role": "user", "content": p}]) for p in prompts]
            outputs[name] = list(zip(ids, [list(o) for o in ran["outputs"]]))
    step_ms = measured_step_ms(args, workloads["grounded"][:args.step_costs])
    cost = row_cost_from(step_ms)
    print(f"CPU: {cpu_model()}, {args.threads} threads; a step of 1 + d rows, in one-row steps: "
          + ", ".join(f"{d}: {cost(d):.2f}" for d in range(args.max_k + 1)))
    print(f"{'workload':>9} {'policy':>24} {'tok/step':>8} {'drafted':>8} {'at this CPU':>11}")
    rows = []
    for name, pairs in outputs.items():
        for policy, drafter in policies(args.max_k):
            r = replay(policy, drafter, pairs)
            row = {"workload": name, **asdict(r), "tokens_per_step": r.tokens_per_step,
                   "drafted_share": r.drafted_steps / r.steps, "speedup_at_this_cpu": r.speedup(cost)}
            rows.append(row)
            print(f"{name:>9} {policy:>24} {r.tokens_per_step:8.2f} {row['drafted_share']:8.0%} "
                  f"{row['speedup_at_this_cpu']:10.2f}x")
    report = {"benchmark": "lookup_bound", "cpu": cpu_model(), "threads": args.threads,
              "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
              "max_tokens": args.max_tokens, "step_ms": step_ms,
              "row_cost": {d: cost(d) for d in range(args.max_k + 1)}, "rows": rows}
    path = write_result("lookup_bound", report)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
