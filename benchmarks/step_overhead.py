"""Host time per engine step, without a model: what the scheduler and the runner's input
preparation cost when B sequences of L tokens each decode one token.

    python benchmarks/step_overhead.py [--batches 64,128] [--context 4000] [--steps 50] [--runs 3]

Measured per step (medians over ``--steps`` steps, then the median of ``--runs`` runs):
    inputs      the runner's part: apply the SchedulerOutput's deltas to the persistent rows,
                build the step's tensors, build the attention metadata (cpu backend)
    host        the whole step's host work: schedule() + inputs + update() (fake sampled tokens)
    baseline    the inputs as the runner built them before the persistent rows (memwall
                a21d38a): Python lists of every sequence's tokens and block table, flattened
                and turned into tensors each step; rebuilt here, in the same run
Writes benchmarks/results/step_overhead-<time>.json with the CPU model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import write_result  # noqa: E402
from memwall.attention.backend import get_backend  # noqa: E402
from memwall.attention.metadata import AttentionMetadata  # noqa: E402
from memwall.config import SchedulerConfig  # noqa: E402
from memwall.core.kv.manager import KVCacheManager  # noqa: E402
from memwall.core.scheduler import Scheduler  # noqa: E402
from memwall.core.step import RunnerOutput, SampledToken  # noqa: E402
from memwall.request import Request  # noqa: E402
from memwall.sampling_params import SamplingParams  # noqa: E402
from memwall.worker.input_batch import RequestRows, StepInputs  # noqa: E402

BLOCK = 16


def make_engine(batch: int, context: int, steps: int):
    # Early sequences decode while later ones still prefill: give every one room for that.
    max_tokens = steps + batch * context // 2048 + 16
    max_len = context + max_tokens
    blocks = batch * (-(-max_len // BLOCK)) + 8
    kv = KVCacheManager(blocks, BLOCK, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=max(2048, batch), max_num_seqs=batch,
                          max_model_len=max_len)
    sched = Scheduler(cfg, kv)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + t) % 30000 + 1 for t in range(context)]  # distinct: no cache hits
        sched.add(Request(f"r{i}", prompt, params, max_tokens))
    return sched, RequestRows(batch, max_len, BLOCK)


def sample_all(sched, out) -> RunnerOutput:
    result = RunnerOutput()
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[rid]
        if request.num_computed_tokens + n == request.num_tokens:
            result.sampled[rid] = SampledToken(1)
    return result


def prefill(sched, rows) -> None:
    """Runs the prompts through (host side only) until a step is decodes only."""
    while True:
        out = sched.schedule()
        rows.update(out)
        sched.update(out, sample_all(sched, out))
        if out.total_num_scheduled_tokens == len(out.num_scheduled_tokens) == len(sched.running):
            return


def baseline_inputs(sched, out) -> None:
    """The pre-rows runner: per step, every sequence's tokens and table as Python lists."""
    ids, positions, query_lens, seq_lens, tables, logit_index = [], [], [], [], [], []
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[rid]
        start = request.num_computed_tokens
        all_ids = request.prompt_token_ids + request.output_token_ids  # old token_slice
        ids.extend(all_ids[start:start + n])
        positions.extend(range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(list(sched.kv.block_table(rid)))
        logit_index.append(len(ids) - 1)
    torch.tensor(ids, dtype=torch.long)
    torch.tensor(positions, dtype=torch.long)
    AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, "cpu", "cpu")


def run(batch: int, context: int, steps: int) -> dict:
    sched, rows = make_engine(batch, context, steps)
    prefill(sched, rows)
    backend = get_backend("cpu")
    inputs_ms, host_ms, base_ms = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        baseline_inputs(sched, out)
        t2 = time.perf_counter()
        rows.update(out)
        inputs = StepInputs.build(rows, out)
        backend.build_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                               inputs.slot_mapping, BLOCK)
        t3 = time.perf_counter()
        sched.update(out, sample_all(sched, out))
        t4 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == batch and out.total_num_scheduled_tokens == batch, (
            len(out.num_scheduled_tokens), out.total_num_scheduled_tokens, len(sched.waiting))
        inputs_ms.append((t3 - t2) * 1e3)
        base_ms.append((t2 - t1) * 1e3)
        host_ms.append(((t1 - t0) + (t3 - t2) + (t4 - t3)) * 1e3)
    return {"inputs_ms": statistics.median(inputs_ms), "host_ms": statistics.median(host_ms),
            "baseline_inputs_ms": statistics.median(base_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu = cpu_model()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        runs = [run(batch, args.context, args.steps) for _ in range(args.runs)]
        row = {"batch": batch, "context": args.context,
               **{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "runs": runs}
        rows.append(row)
    print(f"CPU: {cpu}; {args.steps} decode steps, median of {args.runs} runs")
    print(f"{'B x context':>14} {'inputs ms':>10} {'host ms':>9} {'baseline inputs ms':>19} {'speed-up':>9}")
    for r in rows:
        print(f"{r['batch']:>6} x {r['context']:<6} {r['inputs_ms']:>10.3f} {r['host_ms']:>9.3f} "
              f"{r['baseline_inputs_ms']:>19.3f} {r['baseline_inputs_ms'] / r['inputs_ms']:>8.1f}x")
    path = write_result("step_overhead", {"cpu": cpu, "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
