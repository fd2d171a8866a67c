"""The planner against the engine on this machine: calibrate, predict, measure, compare.

    python benchmarks/plan_validate.py [--threads 2] [--runs 3] [--models smollm,llama-1b]
                                       [--calibration FILE] [--no-calibrate]

``--runs`` times (the machine's speed drifts with its neighbours: each run calibrates right
before it measures, and both sides are medians over the same stretch of time):
1. Calibration: memwall/planner/calibrate.py's ``run`` in a pinned subprocess (``--calibration
   FILE --no-calibrate``: that file, every run).
2. Predictions, from the calibration and each model's shape and GGUF tensor types only (no
   measurement of the model): memwall/planner's plan for ``--device this``, and
       KV bytes/token   the planner's memory plan
       decode tok/s     roofline.decode_step at B=1, at cpu.py's mean context (16-token prompt,
                        128 tokens decoded)
       prefill tok/s    roofline.prefill of cpu.py's 512-token prompt, in the chunks of the step
                        budget the engine picks (planner/serving.py predicts what its start-up
                        measurement, worker/step_shape.py, finds and applies the same policy)
       peak RSS         planner/host.py's resident size for memory.py's run (a 4096-token KV
                        cache, a 512-token prompt and 128 decoded tokens)
3. Measurements in pinned subprocesses: benchmarks/cpu.py's memwall worker (decode and prefill
   tok/s) and benchmarks/memory.py's (peak RSS, VmHWM, and the KV cache the engine allocated,
   per token), as those scripts run them, with the run's calibration file as the engines'
   ``calibration`` (what `memwall serve` does with this machine's): their step budget is the
   one predicted, not one each engine times at start-up (on a shared VM that moved between 288
   and 400 tokens, and the 512-token prompt's chunks and speed with it).

Models: ``smollm`` (the embedded SmolLM2-135M Q4_1 GGUF) and ``llama-1b`` (Llama-3.2-1B's
shape, benchmarks/synthetic_gguf.py's ``cached()``). Prints "predicted vs measured (ratio)" and
writes benchmarks/results/plan_validate-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cpu, memory, synthetic_gguf  # noqa: E402
from benchmarks.report import ROOT, write_result  # noqa: E402

DECODE_PROMPT = 16  # cpu.py's decode run: a 16-token prompt, then --decode-tokens steps
TOLERANCE = 0.15


def model_path(name: str) -> Path:
    if name == "smollm":
        from memwall.planner.sources import embedded_model_path

        return embedded_model_path()
    return synthetic_gguf.cached(name)


# ---- predictions ---------------------------------------------------------------------------
def predict(model: Path, calibration: Path, args: argparse.Namespace) -> dict:
    from memwall.planner.hardware import Device
    from memwall.planner.host import cpu_weights, resident
    from memwall.planner.plan import make_plan
    from memwall.planner.precision import kv_bytes_per_token_head
    from memwall.planner.request import PlanRequest
    from memwall.planner.roofline import decode_step, prefill
    from memwall.planner.serving import serve_sizes

    plan = make_plan(PlanRequest(model=str(model), device="this", calibration=str(calibration),
                                 max_model_len=2048, prompt_len=args.prompt_tokens, batch=1))
    shape, block = plan.model.shape, memory.BLOCK
    # cpu.py's engine: a 256 MiB KV budget, default max_num_seqs (64): the budget's decode
    # batch is 16; memory.py's: --ctx tokens of KV
    kv_token = plan.memory.busiest.kv_bytes_per_token
    cpu_sizes = serve_sizes(plan.decode_model, plan.prefill_model, (256 << 20) // kv_token, 2048,
                            block, str(calibration), max_num_seqs=64)
    mem_sizes = serve_sizes(plan.decode_model, plan.prefill_model, args.ctx, args.ctx, block,
                            str(calibration), max_num_seqs=64)
    context = DECODE_PROMPT + args.decode_tokens // 2
    rates = Device.from_calibration(calibration).host
    rss = resident(rates, shape, cpu_weights(plan.model, plan.quantization),
                   kv_bytes_per_token_head(plan.kv_dtype, shape.head_dim), args.ctx,
                   args.prompt_tokens + args.decode_tokens, mem_sizes.max_num_batched_tokens,
                   block)
    return {"kv_bytes_per_token": kv_token,
            "decode_tok_s": decode_step(plan.decode_model, 1, context).tokens_per_s,
            "prefill_tok_s": prefill(plan.prefill_model, args.prompt_tokens,
                                     cpu_sizes.max_num_batched_tokens).tokens_per_s,
            "peak_rss_mb": rss.total / 2**20,
            "step_budget": cpu_sizes.max_num_batched_tokens,
            "memory_step_budget": mem_sizes.max_num_batched_tokens,
            "rss_parts_mb": {k: v / 2**20 for k, v in vars(rss).items()}}


# ---- measurements --------------------------------------------------------------------------
def measure(model: Path, calibration: Path, args: argparse.Namespace, prompt: str) -> dict:
    """One run of cpu.py's and memory.py's memwall workers on ``model``."""
    speed_args = SimpleNamespace(model=str(model), threads=args.threads,
                                 decode_tokens=args.decode_tokens,
                                 prompt_tokens=args.prompt_tokens)
    # the engines read the run's calibration, as `memwall serve` reads this machine's: their
    # step budget is the one predicted (an engine that times its kernels at start-up picks
    # 288-400 tokens on a shared 2-core VM, and the prompt's chunks with it), max_num_seqs 64
    # as cpu.py's engine has it
    sizing = {"calibration": str(calibration), "max_num_seqs": 64}
    speed = cpu.run_worker("memwall", speed_args, extra=sizing)
    if "error" in speed:
        raise RuntimeError(f"benchmarks/cpu.py's worker failed on {model.name}: {speed['error']}")
    mem_args = SimpleNamespace(model=str(model), threads=args.threads, ctx=args.ctx,
                               decode_tokens=args.decode_tokens, quantization="auto",
                               engine_args=sizing)
    mem = memory.run_memwall(mem_args, prompt)
    if "error" in mem:
        raise RuntimeError(f"benchmarks/memory.py's worker failed on {model.name}: {mem['error']}")
    return {"kv_bytes_per_token": mem.get("kv_bytes_per_token"),
            "decode_tok_s": speed["decode_tok_s"], "prefill_tok_s": speed["prefill_tok_s"],
            "peak_rss_mb": mem["peak_rss_mb"], "step_budget": speed.get("step_budget"),
            "memory_step_budget": mem.get("step_budget")}


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the parts of predicted RSS too)."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = medians([r[key] for r in runs])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


# ---- report --------------------------------------------------------------------------------
ROWS = (("kv_bytes_per_token", "KV bytes/token", ",.0f"), ("decode_tok_s", "B=1 decode tok/s", ".1f"),
        ("prefill_tok_s", "prefill tok/s (512)", ".1f"), ("peak_rss_mb", "peak RSS MB", ".0f"))


def compare(runs: list[dict]) -> dict:
    """Per figure: the medians of the predictions and of the measurements, and the median (and
    range) of each run's ratio, prediction / measurement (a run calibrates, then measures: its
    two sides share the machine's speed of that minute)."""
    out = {}
    for key, _, _ in ROWS:
        ratios = [r["predicted"][key] / r["measured"][key] for r in runs
                  if r["predicted"].get(key) and r["measured"].get(key)]
        ratio = statistics.median(ratios) if ratios else None
        out[key] = {"predicted": statistics.median(r["predicted"][key] for r in runs),
                    "measured": statistics.median(r["measured"][key] for r in runs)
                    if all(r["measured"].get(key) for r in runs) else None,
                    "ratio": ratio, "ratios": ratios,
                    "within_15pct": ratio is not None and abs(ratio - 1) <= TOLERANCE}
    return out


def print_table(report: dict) -> None:
    print(f"\n{report['cpu']} ({report['isa']}), {report['threads']} threads, "
          f"{report['time']}, medians of {report['runs']} runs (each: calibrate, then measure)")
    print("predicted vs measured (median of the runs' ratios; their range)")
    names = list(report["models"])
    width = max(len(label) for _, label, _ in ROWS) + 2
    col = 36
    print(" " * width + "".join(n.rjust(col) for n in names))
    for key, label, spec in ROWS:
        cells = []
        for name in names:
            row = report["models"][name]["compare"][key]
            p, m, r, rs = row["predicted"], row["measured"], row["ratio"], row["ratios"]
            spread = f"; {min(rs):.2f}-{max(rs):.2f}" if len(rs) > 1 and min(rs) != max(rs) else ""
            text = "n/a" if p is None or m is None else (
                f"{format(p, spec)} vs {format(m, spec)} ({r:.2f}{spread})")
            cells.append(text.rjust(col))
        print(label.ljust(width) + "".join(cells))
    for name in names:
        entry = report["models"][name]
        print(f"{name}: step budget predicted {entry['predicted']['step_budget']:.0f}, engine "
              f"{entry['measured']['step_budget']:.0f}; predicted RSS parts (MB) " +
              ", ".join(f"{k} {v:.0f}" for k, v in entry["predicted"]["rss_parts_mb"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="smollm,llama-1b")
    parser.add_argument("--calibration", default=None,
                        help="calibration file (default: benchmarks/results/"
                             "calibration-<time>-<run>.json, written by each run)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use --calibration as it is instead of measuring")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=4096, help="memory.py's KV cache, tokens")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.no_calibrate and not (args.calibration and Path(args.calibration).is_file()):
        parser.error("--no-calibrate needs an existing --calibration file")
    names = args.models.split(",")
    paths = {name: model_path(name) for name in names}
    prompts = {name: memory.make_prompt(str(path), args.prompt_tokens)
               for name, path in paths.items()}
    runs: dict[str, list] = {name: [] for name in names}
    calibrations = []
    for run in range(args.runs):
        calibration = Path(args.calibration or ROOT / "benchmarks" / "results" /
                           f"calibration-{stamp}-{run + 1}.json")
        if not args.no_calibrate:
            calibrate_pinned(calibration, args.threads)
        calibrations.append(json.loads(calibration.read_text()))
        for name, path in paths.items():
            print(f"run {run + 1}/{args.runs}: {name} ({path.name}) ...", file=sys.stderr,
                  flush=True)
            runs[name].append({"predicted": predict(path, calibration, args),
                               "measured": measure(path, calibration, args, prompts[name])})
    models = {}
    for name in names:
        predicted = medians([r["predicted"] for r in runs[name]])
        measured = medians([r["measured"] for r in runs[name]])
        models[name] = {"model": paths[name].name, "predicted": predicted, "measured": measured,
                        "compare": compare(runs[name]), "runs": runs[name]}
    report = {"benchmark": "plan_validate", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cpu": cpu.cpu_model(), "isa": calibrations[0].get("isa"),
              "threads": args.threads, "runs": args.runs, "calibrations": calibrations,
              "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens,
              "ctx": args.ctx, "models": models}
    print_table(report)
    print(f"\nwrote {write_result('plan_validate', report).relative_to(ROOT)}")


def calibrate_pinned(path: Path, threads: int) -> None:
    """calibrate.run in a subprocess pinned to the cores the measured engines get."""
    import subprocess

    code = f"from memwall.planner import calibrate; calibrate.run({str(path)!r})"
    cmd = cpu._pinned(threads) + [sys.executable, "-c", code]
    subprocess.run(cmd, check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
