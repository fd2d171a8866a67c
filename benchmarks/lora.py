"""Multi-LoRA serving: what adapters cost, and what the adapter-aware cache buys (issue 18).

    python benchmarks/lora.py [--model GGUF] [--threads 2] [--runs 3] [--max-tokens 128]
                              [--adapters 8] [--rank 16] [--targets q_proj,v_proj]
                              [--churn-requests 120] [--pool-prompts 6] [--skip-churn]

Both parts run the engine in this process (no HTTP), pinned threads, on the embedded
SmolLM2-135M (Q4_1 GGUF) by default. Adapters are written here as PEFT directories with random
A and B (the base's shapes; PEFT's default targets q_proj and v_proj unless --targets).

- ``throughput``: ``--requests`` prompts, at most 8 in flight (closed loop, a new one as one
  finishes), ``--max-tokens`` each (EOS ignored, so every variant does the same work). Base-only
  on an engine without LoRA vs the same prompts spread round-robin over ``--adapters`` adapters
  (``--max-loras`` = that many), and base requests on the LoRA engine. Output tokens/s, medians
  of ``--runs`` runs, the variants' order rotating from run to run.
- ``churn``: 16 adapters, ``--max-loras 4``, ``--max-cpu-loras 8``, each adapter with its own
  system prompt (``--system-tokens``) followed by a short question; adapters drawn with Zipf
  popularity (s = ``--zipf``) and Poisson arrivals (``--rate`` req/s). The KV pool holds about
  ``--pool-prompts`` system prompts, so the cache policy decides which prefixes survive.
  The same request trace runs under ``lora_cache_policy="adapter-aware"`` (content-hash keys,
  eviction weighed by each adapter's request rate) and ``"vllm"`` (name keys, LRU evictions).
  TTFT p50 (and p25/p75/p90), prefix-cache hit rate, adapter loads. Both get the same memory:
  vllm a KV pool of that size beside its host cache of 8 adapters, adapter-aware one pool of
  the KV blocks plus the bytes of those 8 adapters, holding weights and KV alike (the unified
  pool), from which it drops idle adapters or least-used KV blocks, whichever is worth less.

Writes benchmarks/results/lora-<time>.json with the CPU model.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import engine_bench_parser, write_result  # noqa: E402
from benchmarks.servers import embedded_gguf  # noqa: E402


def write_adapter(folder: Path, arch, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA directory for the base ``arch`` with random A (scaled like PEFT's
    kaiming init) and small random B, so outputs change but stay fluent-ish."""
    import torch
    from safetensors.torch import save_file

    from memwall.lora.slots import target_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(arch)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for target in targets:
            k, n = shapes[target]
            owner = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=gen) / k ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none"}))
    return folder


def _engine(model: str, threads: int, **kw):
    from memwall import LLM

    return LLM(model, threads=threads, **kw)


# ---- throughput --------------------------------------------------------------------------------
def closed_loop(llm, prompts: list[list[int]], loras: list, max_tokens: int, concurrency: int) -> dict:
    """Keeps ``concurrency`` requests in flight until all ran; output tokens/s."""
    from memwall import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queue = list(zip(prompts, loras))
    in_flight, tokens, next_id = 0, 0, 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            prompt, lora = queue.pop(0)
            engine.add_request(f"t{next_id}", prompt, params, lora)
            next_id += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def throughput(args, model: str, arch, adapters: list) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(24, 64))]
               for _ in range(args.requests)]
    base_llm = _engine(model, args.threads, max_num_seqs=args.concurrency)
    lora_llm = _engine(model, args.threads, max_num_seqs=args.concurrency, enable_lora=True,
                       max_loras=len(adapters), max_lora_rank=args.rank,
                       max_cpu_loras=len(adapters))
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    closed_loop(lora_llm, prompts[:len(adapters)], spread[:len(adapters)], 4, args.concurrency)
    closed_loop(base_llm, prompts[:2], [None] * 2, 4, args.concurrency)  # warm both
    rows: dict[str, list[float]] = {"base only (no LoRA engine)": [], "base on the LoRA engine": [],
                                    f"{len(adapters)} adapters": []}
    variants = [("base only (no LoRA engine)", base_llm, [None] * len(prompts)),
                (f"{len(adapters)} adapters", lora_llm, spread),
                ("base on the LoRA engine", lora_llm, [None] * len(prompts))]
    for run in range(args.runs):  # the order rotates: no variant always runs first
        for name, llm, loras in variants[run % 3:] + variants[:run % 3]:
            result = closed_loop(llm, prompts, loras, args.max_tokens, args.concurrency)
            rows[name].append(result["tok_s"])
            print(f"  run {run + 1} {name}: {result['tok_s']:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rows.items()}
    base = medians["base only (no LoRA engine)"]
    return {"concurrency": args.concurrency, "requests": args.requests,
            "max_tokens": args.max_tokens, "runs": rows, "median_tok_s": medians,
            "ratio_vs_base": {name: v / base for name, v in medians.items()},
            "fused_decode": _fused(lora_llm)}


def _fused(llm) -> bool:
    runner = llm.engine.core.executor.worker.runner
    return bool(getattr(runner.fast_path, "runs_lora", False))


# ---- churn -------------------------------------------------------------------------------------
def churn_trace(args, seed: int = 0) -> list[tuple[float, int, list[int]]]:
    """(arrival s, adapter index, prompt ids): Zipf-popular adapters, Poisson arrivals."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40000) for _ in range(args.system_tokens)]
               for _ in range(args.churn_adapters)]
    weights = [1 / (i + 1) ** args.zipf for i in range(args.churn_adapters)]
    trace, t = [], 0.0
    for _ in range(args.churn_requests):
        t += rng.expovariate(args.rate)
        a = rng.choices(range(args.churn_adapters), weights)[0]
        question = [rng.randrange(100, 40000) for _ in range(args.question_tokens)]
        trace.append((t, a, systems[a] + question))
    return trace


def replay(llm, trace, loras, max_tokens: int) -> dict:
    """Adds each request at its arrival time, steps the engine; TTFT per request."""
    from memwall import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(trace))
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (arrival, a, prompt) = pending.pop(0)
            rid = f"c{i}"
            engine.add_request(rid, prompt, params, loras[a])
            sent[rid] = start + arrival
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][1][0] - now)) if pending else 0)
            continue
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - sent[out.request_id]
                cached[out.request_id] = out.num_cached_tokens
    values = sorted(ttft.values())
    q = statistics.quantiles(values, n=20)
    stats = engine.stats
    return {"ttft_p25_s": q[4], "ttft_p50_s": statistics.median(values), "ttft_p75_s": q[14],
            "ttft_p90_s": q[17], "ttft_mean_s": statistics.fmean(values),
            "prefix_hit_rate": stats.prefix_cache_hit_rate,
            "requests_with_cached_prefix": sum(1 for c in cached.values() if c > 0) / len(cached),
            "adapter_loads": stats.lora.loads, "adapter_evictions": stats.lora.evictions,
            "kv_evictions": stats.prefix_cache_evictions,
            "seconds": time.perf_counter() - start}


def churn(args, model: str, arch, root: Path) -> dict:
    from memwall.lora import LoRARequest
    from memwall.lora.slots import target_shapes

    folders = [write_adapter(root / f"churn{i}", arch, args.rank, args.targets, seed=100 + i)
               for i in range(args.churn_adapters)]
    trace = churn_trace(args)
    block = 16
    prompt_blocks = -(-(args.system_tokens + args.question_tokens) // block)
    num_blocks = int(args.pool_prompts * prompt_blocks)
    # Equal memory: vllm keeps its 8 host-cached adapters beside a KV pool of num_blocks; the
    # unified pool gets the same bytes as blocks (fp16 KV, the CPU default) and shares them.
    block_bytes = block * 2 * arch.num_key_value_heads * arch.head_dim * 2 * arch.num_hidden_layers
    adapter_bytes = 4 * args.rank * arch.num_hidden_layers * sum(
        k + n for t, (k, n) in target_shapes(arch).items() if t in args.targets)
    adapter_blocks = -(-adapter_bytes // block_bytes)
    pools = {"adapter-aware": num_blocks + 8 * adapter_blocks, "vllm": num_blocks}
    result = {"adapters": args.churn_adapters, "max_loras": 4, "max_cpu_loras": 8, "max_num_seqs": args.churn_seqs,
              "adapter_mb": adapter_bytes / 2**20, "adapter_blocks": adapter_blocks,
              "kv_blocks_per_policy": pools,
              "zipf": args.zipf, "rate_req_s": args.rate, "requests": args.churn_requests,
              "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
              "kv_blocks": num_blocks, "block_size": block, "runs": {}}
    for policy in ("adapter-aware", "vllm"):
        result["runs"][policy] = []
    for run in range(args.runs):
        for policy in ("adapter-aware", "vllm"):
            llm = _engine(model, args.threads, max_num_seqs=args.churn_seqs, enable_lora=True, max_loras=4,
                          max_lora_rank=args.rank, max_cpu_loras=8, num_kv_blocks=pools[policy],
                          block_size=block, lora_cache_policy=policy)
            loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
            r = replay(llm, trace, loras, args.churn_max_tokens)
            llm.engine.shutdown()
            result["runs"][policy].append(r)
            print(f"  run {run + 1} {policy}: TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, "
                  f"hit rate {r['prefix_hit_rate']:.2f}, loads {r['adapter_loads']}", flush=True)
    med = {p: statistics.median(r["ttft_p50_s"] for r in runs) for p, runs in result["runs"].items()}
    result["median_ttft_p50_s"] = med
    result["ttft_p50_reduction"] = 1 - med["adapter-aware"] / med["vllm"]
    return result


def main() -> None:
    parser = engine_bench_parser(__doc__)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--churn-adapters", type=int, default=16)
    parser.add_argument("--churn-requests", type=int, default=120)
    parser.add_argument("--churn-max-tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=0.6)
    parser.add_argument("--pool-prompts", type=float, default=6.0)
    parser.add_argument("--churn-seqs", type=int, default=2,
                        help="max_num_seqs of the churn engines (the pool holds the running "
                             "requests' blocks too: more would preempt at these pool sizes)")
    parser.add_argument("--skip-churn", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    args.targets = args.targets.split(",")
    import torch

    from memwall.loader.model_loader import load_model  # noqa: F401 - fail early if missing
    from memwall.lora import LoRARequest

    torch.set_num_threads(args.threads)
    model = args.model or str(embedded_gguf())
    probe = _engine(model, args.threads, num_kv_blocks=16)
    arch = probe.engine.core.executor.worker.loaded.arch
    probe.engine.shutdown()
    out = {"cpu": cpu_model(), "threads": args.threads, "model": Path(model).name,
           "rank": args.rank, "targets": args.targets}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if not args.skip_throughput:
            adapters = [LoRARequest(f"t{i}", i + 1, str(write_adapter(
                root / f"t{i}", arch, args.rank, args.targets, seed=i))) for i in range(args.adapters)]
            print(f"throughput, c={args.concurrency} ({cpu_model()}, {args.threads} threads)")
            out["throughput"] = throughput(args, model, arch, adapters)
        if not args.skip_churn:
            print("churn")
            out["churn"] = churn(args, model, arch, root)
    print_table(out)
    print("wrote", write_result("lora", out))


def print_table(out: dict) -> None:
    print(f"\n{out['cpu']}, {out['threads']} threads, {out['model']}, rank {out['rank']} "
          f"adapters on {'/'.join(out['targets'])}")
    if "throughput" in out:
        t = out["throughput"]
        print(f"| c={t['concurrency']} | out tok/s (median) | vs base-only |\n|---|---|---|")
        for name, v in t["median_tok_s"].items():
            print(f"| {name} | {v:.1f} | {t['ratio_vs_base'][name]:.2f}x |")
    if "churn" in out:
        c = out["churn"]
        print(f"\nchurn: {c['adapters']} adapters, Zipf {c['zipf']}, {c['rate_req_s']} req/s, "
              f"pools (blocks of 16) {c['kv_blocks_per_policy']}, an adapter "
              f"{c['adapter_mb']:.1f} MB = {c['adapter_blocks']} blocks")
        print("| policy | TTFT p50 ms (median of runs) | p25 | p75 | hit rate | adapter loads |\n"
              "|---|---|---|---|---|---|")
        for policy, runs in c["runs"].items():
            mid = sorted(runs, key=lambda r: r["ttft_p50_s"])[len(runs) // 2]
            print(f"| {policy} | {mid['ttft_p50_s'] * 1e3:.0f} | {mid['ttft_p25_s'] * 1e3:.0f} | "
                  f"{mid['ttft_p75_s'] * 1e3:.0f} | {mid['prefix_hit_rate']:.2f} | "
                  f"{mid['adapter_loads']} |")
        print(f"TTFT p50 reduction: {c['ttft_p50_reduction'] * 100:.0f}%")


if __name__ == "__main__":
    main()
