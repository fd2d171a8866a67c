"""Structured output: what a JSON schema costs, in one process (issue 16).

    python benchmarks/structured.py [--model GGUF] [--threads 2] [--runs 3] [--max-tokens 128]
                                    [--requests 8] [--concurrency 16] [--ttft-trials 8]

Rows (the embedded SmolLM2-135M by default, greedy, pinned threads, medians of ``--runs``;
constrained and unconstrained runs alternate on the same engine):

- ``batch 1``: ``--requests`` prompts one at a time, each with its own JSON schema (from
  tests/structured/schemas.py), and the same prompts without one, generating exactly as many
  tokens as the constrained output had (EOS ignored): like for like. Output tokens/s end to
  end, and in the decode phase (tokens after the first / time after the first).
- ``c=N``: N requests at once (``max_num_seqs=N``), engine throughput.
- ``TTFT``: time to first token of a request whose schema the engine has never seen (compiled
  while it waits) vs an unconstrained request, median of ``--ttft-trials``.
- backends: llguidance and xgrammar, compile time per schema (all 52 test schemas) and the
  per-token mask time replaying the engine's own constrained outputs.

Writes benchmarks/results/structured-<time>.json with the CPU model.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import ROOT, engine_bench_parser, write_result  # noqa: E402
from tests.structured.schemas import SCHEMAS  # noqa: E402 - the 52 schemas the tests validate


def prompt(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Reply with one JSON value that matches this JSON schema:\n"
                                        + json.dumps(schema)}]


def params_for(schema: dict | None, max_tokens: int, exact: bool = False):
    """``exact``: exactly ``max_tokens`` tokens (EOS ignored): the unconstrained twin of a
    constrained request does the same number of steps, so tokens/s compare like for like."""
    from memwall import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint,
                          ignore_eos=exact)


def _lengths(lengths: list[int] | int, count: int) -> list[int]:
    return lengths if isinstance(lengths, list) else [lengths] * count


def run_alone(llm, schemas: list[dict], constrained: bool, max_tokens: list[int] | int) -> dict:
    tokens = decode_tokens = 0
    decode_seconds, outputs = 0.0, []
    start = time.perf_counter()
    for schema, limit in zip(schemas, _lengths(max_tokens, len(schemas))):
        params = params_for(schema, limit) if constrained else params_for(None, limit, exact=True)
        out = llm.chat(prompt(schema), params)[0]
        ids = out.outputs[0].token_ids
        tokens += len(ids)
        outputs.append(list(ids))
        decode_tokens += len(ids) - 1
        decode_seconds += out.metrics.finished_time - out.metrics.first_token_time
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": tokens / elapsed,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else None,
            "outputs": outputs}


def run_together(llm, schemas: list[dict], constrained: bool, max_tokens: list[int] | int) -> dict:
    params = [params_for(s, n) if constrained else params_for(None, n, exact=True)
              for s, n in zip(schemas, _lengths(max_tokens, len(schemas)))]
    start = time.perf_counter()
    outs = llm.chat([prompt(s) for s in schemas], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "tok_s": tokens / elapsed, "decode_tok_s": None,
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def compare(name: str, llm, run, schemas: list[dict], max_tokens: int, runs: int) -> dict:
    """Constrained requests, and unconstrained ones of exactly the same output lengths (the
    constrained outputs' own, learnt in a first pass that also warms up the compiles)."""
    results = {"plain": [], "schema": []}
    lengths = [len(ids) for ids in run(llm, schemas, True, max_tokens)["outputs"]]
    run(llm, schemas[:2], False, 8)
    for i in range(runs):
        for label in (("plain", "schema") if i % 2 == 0 else ("schema", "plain")):
            limits = max_tokens if label == "schema" else lengths
            results[label].append(run(llm, schemas, label == "schema", limits))
    rate = {k: statistics.median(r["tok_s"] for r in v) for k, v in results.items()}
    decode = {k: [r["decode_tok_s"] for r in v if r["decode_tok_s"]] for k, v in results.items()}
    decode_rate = {k: statistics.median(v) if v else None for k, v in decode.items()}
    row = {"workload": name, "requests": len(schemas),
           "plain_tok_s": rate["plain"], "schema_tok_s": rate["schema"],
           "ratio": rate["schema"] / rate["plain"],
           "plain_runs": [r["tok_s"] for r in results["plain"]],
           "schema_runs": [r["tok_s"] for r in results["schema"]],
           "plain_decode_tok_s": decode_rate["plain"], "schema_decode_tok_s": decode_rate["schema"],
           "decode_ratio": (decode_rate["schema"] / decode_rate["plain"]
                            if decode_rate["plain"] and decode_rate["schema"] else None),
           "plain_tokens": results["plain"][-1]["tokens"],
           "schema_tokens": results["schema"][-1]["tokens"],
           "valid_json": _valid(llm, schemas, results["schema"][-1]["outputs"])}
    phase = (f"{decode_rate['plain']:>9.1f} {decode_rate['schema']:>9.1f} {row['decode_ratio']:>7.2f}x"
             if row["decode_ratio"] else f"{'-':>9} {'-':>9} {'-':>8}")
    print(f"{name:>10} {len(schemas):>4} {rate['plain']:>9.1f} {rate['schema']:>9.1f} "
          f"{row['ratio']:>7.2f}x {phase} {row['valid_json']:>6.0%}", flush=True)
    return row


def _valid(llm, schemas: list[dict], outputs: list[list[int]]) -> float:
    import jsonschema

    good = 0
    for schema, ids in zip(schemas, outputs):
        try:
            jsonschema.validate(json.loads(llm.tokenizer.decode(ids)), schema)
            good += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return good / len(schemas)


def ttft(llm, trials: int, max_tokens: int = 4) -> dict:
    """A never-seen schema each trial (a fresh property name) vs no schema, alternating."""
    times = {"plain": [], "new_schema": []}
    for i in range(trials):
        schema = {"type": "object", "properties": {f"field_{time.monotonic_ns()}_{i}": {"type": "string"},
                                                   "n": {"type": "integer"}}, "required": ["n"]}
        for label in (("plain", "new_schema") if i % 2 == 0 else ("new_schema", "plain")):
            out = llm.chat(prompt(schema), params_for(schema if label == "new_schema" else None,
                                                      max_tokens))[0]
            times[label].append(out.metrics.first_token_time - out.metrics.arrival_time)
    plain, new = statistics.median(times["plain"]), statistics.median(times["new_schema"])
    print(f"TTFT, batch 1: unconstrained {1e3 * plain:.1f} ms, never-seen schema {1e3 * new:.1f} ms "
          f"({new / plain:.2f}x)", flush=True)
    return {"plain_ms": 1e3 * plain, "new_schema_ms": 1e3 * new, "ratio": new / plain,
            "plain_runs_ms": [1e3 * t for t in times["plain"]],
            "new_schema_runs_ms": [1e3 * t for t in times["new_schema"]]}


def backend_costs(name: str, vocab, outputs: list[tuple[dict, list[int]]]) -> dict:
    """Compile time per schema (a fresh backend: nothing cached) and mask time per token."""
    from memwall import StructuredOutputsParams
    from memwall.structured import make_backend

    start = time.perf_counter()
    backend = make_backend(name, vocab)
    init = time.perf_counter() - start
    compile_s, compiled = [], {}
    for i, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        compiled[i] = backend.compile(StructuredOutputsParams(json=schema))
        compile_s.append(time.perf_counter() - start)
    mask_s = []
    for schema, ids in outputs:
        grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(json=schema)))
        for token in ids:
            start = time.perf_counter()
            grammar.bitmask()
            mask_s.append(time.perf_counter() - start)
            if not grammar.accept([token]) or grammar.is_terminated:
                break
    row = {"backend": name, "init_ms": 1e3 * init,
           "compile_ms_median": 1e3 * statistics.median(compile_s),
           "compile_ms_max": 1e3 * max(compile_s), "mask_us_median": 1e6 * statistics.median(mask_s),
           "mask_us_p90": 1e6 * statistics.quantiles(mask_s, n=10)[-1], "tokens_masked": len(mask_s)}
    print(f"{name:>11}: vocabulary table {row['init_ms']:.0f} ms; compile median "
          f"{row['compile_ms_median']:.2f} ms (max {row['compile_ms_max']:.1f}) over {len(SCHEMAS)} "
          f"schemas; mask median {row['mask_us_median']:.1f} us (p90 {row['mask_us_p90']:.1f}) "
          f"over {len(mask_s)} tokens", flush=True)
    return row


def main() -> None:
    parser = engine_bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ttft-trials", type=int, default=8)
    args = parser.parse_args()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
    from memwall import LLM
    from memwall.structured import VocabInfo

    llm = LLM(args.model, threads=args.threads, max_num_seqs=args.concurrency,
              kv_cache_memory=1 << 30)
    print(f"CPU: {cpu_model()}, {args.threads} threads; {llm.engine.describe()}")
    print(f"{'':>15} {'end to end, tok/s':>28} {'decode phase, tok/s':>29}")
    print(f"{'workload':>10} {'reqs':>4} {'plain':>9} {'schema':>9} {'ratio':>8} {'plain':>9} "
          f"{'schema':>9} {'ratio':>8} {'valid':>6}")
    # every 5th schema: objects, arrays, enums, patterns, anyOf, $refs in the mix
    alone = SCHEMAS[::5][:args.requests]
    together = (SCHEMAS * 2)[:args.concurrency]
    rows = [compare("batch 1", llm, run_alone, alone, args.max_tokens, args.runs),
            compare(f"c={args.concurrency}", llm, run_together, together, args.max_tokens, args.runs)]
    first = ttft(llm, args.ttft_trials)
    tok = llm.tokenizer
    vocab = VocabInfo(tok.backend, llm.engine.vocab_size, tuple(sorted(tok.eos_token_ids)))
    replay = run_together(llm, SCHEMAS, True, args.max_tokens)["outputs"]
    backends = []
    for name in ("llguidance", "xgrammar"):
        try:
            backends.append(backend_costs(name, vocab, list(zip(SCHEMAS, replay))))
        except ValueError as e:  # xgrammar not installed
            print(f"{name}: {e}")
    report = {"benchmark": "structured", "cpu": cpu_model(), "threads": args.threads,
              "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
              "max_tokens": args.max_tokens, "runs": args.runs, "rows": rows, "ttft": first,
              "backends": backends, "engine": llm.engine.describe()}
    path = write_result("structured", report)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
