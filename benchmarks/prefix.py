"""Prefix-heavy serving benchmark: memwall with prefix caching on vs off, same load, one run.

    python benchmarks/prefix.py [--model GGUF] [--concurrency 8] [--questions 64]

Workloads through `memwall serve` (a subprocess per setting, pinned to --threads cores):
* system: a ~2,000-token shared system prompt followed by each of N distinct questions;
* chat: multi-turn ShareGPT conversations replayed as a chat client sends them: each turn's
  prompt is the whole conversation so far, the model's own earlier replies included (turns of
  one conversation go in order, conversations run side by side); synthetic turns when the
  package is missing;
* chat-recorded: the same user turns, but the history carries ShareGPT's recorded replies
  instead of the model's (text the server never generated, so it can only hit on the turns
  before them: a lower bound);
* assistant: the chat workload after a shared ~1,000-token system prompt, as a chat product
  or agent sends with every turn.
Reported per workload: TTFT p50/p90, request throughput, prefix-cache hit rate (from /metrics),
and the on/off ratios. Greedy decoding, so both settings see the same conversations.
JSON goes to benchmarks/results/prefix-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.datasets import (GGUFTokenizer, SampleRequest, random_prompt, read_records,  # noqa: E402
                                 sharegpt_path)
from benchmarks.loadgen import LoadConfig, RequestResult, make_client, resolve_model, send_request  # noqa: E402
from benchmarks.loadgen import completion_payload  # noqa: E402
from benchmarks.metrics import percentile, summarize  # noqa: E402
from benchmarks.servers import ManagedServer, embedded_gguf, free_port, memwall_command  # noqa: E402
from benchmarks.cpu import cpu_model  # noqa: E402
from benchmarks.report import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- workloads ------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """Turns sent in order; turn t's prompt is every segment and reply before it plus its own
    segment. ``replies`` None: the model's own replies from this run (a chat client), each of
    ``output_lens[t]`` tokens (None: the run's fixed length)."""

    segments: list[str]
    replies: list[str] | None = None
    output_lens: list[int] | None = None


def system_prompt_workload(tok, questions: int, system_tokens: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    system = random_prompt(tok, system_tokens, rng)
    return [Conversation([system + f"\n\nQuestion {i + 1}: " + random_prompt(tok, 24, rng) + "?\nAnswer:"])
            for i in range(questions)]


def chat_workload(tok, conversations: int, turns: int, max_len: int, output_len: int, seed: int,
                  system_tokens: int = 0, recorded_replies: bool = False) -> list[Conversation]:
    """ShareGPT conversations of at least ``turns`` exchanges that fit in ``max_len`` tokens,
    after an optional shared system prompt of ``system_tokens`` tokens. The model's replies are
    as long as the recorded ones (clipped to 8..``output_len`` tokens), as vLLM's ShareGPT
    benchmark takes its output lengths; so turns end at different times, as in real use,
    instead of every conversation finishing each turn in the same step."""
    system = random_prompt(tok, system_tokens, random.Random(seed + 1)) + "\n" if system_tokens else ""
    try:
        records = [r for r in read_records(sharegpt_path()) if len(r.get("conversations") or []) >= 2 * turns]
        random.Random(seed).shuffle(records)
        dialogues = [[m.get("value", "") for m in r["conversations"][: 2 * turns]] for r in records]
    except RuntimeError:
        rng = random.Random(seed)
        dialogues = [[random_prompt(tok, rng.randrange(40, 120), rng) for _ in range(2 * turns)]
                     for _ in range(conversations * 3)]
    convs = []
    for messages in dialogues:
        segments = [f"\nUser: {messages[2 * t]}\nAssistant:" for t in range(turns)]
        segments[0] = system + segments[0]
        replies = [f" {messages[2 * t + 1]}" for t in range(turns)]
        lens = [min(output_len, max(8, len(tok.encode(r)))) for r in replies]
        if recorded_replies:  # the last turn's reply is generated, not sent back
            length = len(tok.encode("".join(s + r for s, r in zip(segments, replies)))) + lens[-1]
            conv = Conversation(segments, replies, lens)
        else:  # a few tokens more per reply where generated text re-tokenizes differently
            length = len(tok.encode("".join(segments))) + sum(n + 4 for n in lens)
            conv = Conversation(segments, output_lens=lens)
        if length <= max_len:
            convs.append(conv)
        if len(convs) == conversations:
            return convs
    raise ValueError(f"only {len(convs)} conversations of {turns} turns fit in {max_len} tokens")


# ---- running -------------------------------------------------------------------------------------
async def replay(base_url: str, convs: list[Conversation], concurrency: int,
                 output_len: int) -> tuple[list[RequestResult], float]:
    cfg = LoadConfig(base_url=base_url, concurrency=concurrency, ignore_eos=True)
    url = f"{base_url}/v1/completions"
    gate = asyncio.Semaphore(concurrency)
    async with make_client(cfg, concurrency) as client:
        model = await resolve_model(client, base_url)
        results: list[RequestResult] = []

        async def one_conversation(conv: Conversation) -> None:
            async with gate:  # a conversation holds its slot: its turns come one after another
                history = ""
                for t, segment in enumerate(conv.segments):
                    history += segment
                    tokens = conv.output_lens[t] if conv.output_lens else output_len
                    req = SampleRequest(history, 0, tokens)
                    result = await send_request(client, url, completion_payload(cfg, model, req),
                                                RequestResult(0, tokens))
                    result.prompt_len = result.server_prompt_tokens
                    results.append(result)
                    history += conv.replies[t] if conv.replies is not None else result.text

        start = time.perf_counter()
        await asyncio.gather(*(one_conversation(c) for c in convs))
        return results, time.perf_counter() - start


def cache_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text
    wanted = {"memwall:prefix_cache_queries_total": "queries", "memwall:prefix_cache_hits_total": "hits"}
    found = {}
    for line in text.splitlines():
        name = line.split(" ")[0]
        if name in wanted:
            found[wanted[name]] = float(line.split()[-1])
    return found


def run_setting(args, caching: bool, workloads: dict) -> dict:
    extra = [] if caching else ["--no-prefix-caching"]
    # room for every conversation's whole history: the cache, not the pool's size, is measured
    extra += ["--max-model-len", "8192", "--kv-cache-memory", str(args.kv_cache_gib << 30)]
    extra += args.server_args.split()
    port = free_port()
    command = memwall_command(args.model, port, args.threads, max(16, args.concurrency), extra)
    out = {}
    with ManagedServer(command, port) as server:
        warm = [Conversation(["Hello there, warm up."])]
        asyncio.run(replay(server.base_url, warm, 1, 2))
        for name, convs in workloads.items():
            before = cache_counters(server.base_url)
            # chat turns carry their own lengths; output_len is the system questions' answer
            results, duration = asyncio.run(replay(server.base_url, convs, args.concurrency,
                                                   args.output_len))
            after = cache_counters(server.base_url)
            summary = summarize(results, duration)
            ttfts = [r.ttft for r in results if r.success]
            queries = after.get("queries", 0) - before.get("queries", 0)
            hits = after.get("hits", 0) - before.get("hits", 0)
            out[name] = {"requests": len(results), "failed": summary.failed, "duration_s": duration,
                         "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p90_ms": percentile(ttfts, 90) * 1000,
                         "request_throughput": summary.request_throughput,
                         "prompt_tokens": summary.total_input_tokens,
                         "hit_rate": hits / queries if queries else 0.0}
            print(f"  caching={'on' if caching else 'off'} {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16, help="tokens per system-workload answer")
    parser.add_argument("--chat-output-len", type=int, default=256,
                        help="longest chat reply (tokens); replies are as long as ShareGPT's, up to this")
    parser.add_argument("--chat-max-len", type=int, default=6000,
                        help="longest conversation (tokens, replies included) the chat sets take")
    parser.add_argument("--kv-cache-gib", type=int, default=3, help="each server's KV pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--assistant-system-tokens", type=int, default=1000,
                        help="the assistant workload's shared system prompt")
    parser.add_argument("--server-args", default="",
                        help="more `memwall serve` flags for both settings, e.g. "
                             "'--max-num-batched-tokens 512'")
    parser.add_argument("--workloads", default="system,chat,chat-recorded,assistant",
                        help="which to run, of system, chat, chat-recorded, assistant")
    args = parser.parse_args()
    args.model = args.model or str(embedded_gguf())
    tok = GGUFTokenizer(args.model)
    chat = dict(conversations=args.conversations, turns=args.turns, output_len=args.chat_output_len,
                seed=args.seed)
    makers = {
        "system": lambda: system_prompt_workload(tok, args.questions, args.system_tokens, args.seed),
        "chat": lambda: chat_workload(tok, max_len=args.chat_max_len, **chat),
        "chat-recorded": lambda: chat_workload(tok, max_len=args.chat_max_len, recorded_replies=True, **chat),
        "assistant": lambda: chat_workload(tok, max_len=args.chat_max_len + args.assistant_system_tokens,
                                           system_tokens=args.assistant_system_tokens, **chat),
    }
    workloads = {name: makers[name]() for name in args.workloads.split(",")}
    results = {"on": run_setting(args, True, workloads), "off": run_setting(args, False, workloads)}
    report = {"cpu": cpu_model(), "threads": args.threads, "concurrency": args.concurrency,
              "model": Path(args.model).name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "args": vars(args), "results": results}
    print(f"\nCPU: {report['cpu']}, {args.threads} threads, concurrency {args.concurrency}")
    header = f"{'workload':<14}{'caching':>8}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'req/s':>9}{'hit rate':>10}"
    print(header + "\n" + "-" * len(header))
    for name in workloads:
        for setting in ("on", "off"):
            r = results[setting][name]
            print(f"{name:<14}{setting:>8}{r['ttft_p50_ms']:>13.0f}{r['ttft_p90_ms']:>13.0f}"
                  f"{r['request_throughput']:>9.2f}{r['hit_rate']:>10.1%}")
        on, off = results["on"][name], results["off"][name]
        print(f"{name:<14}{'ratio':>8}  TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower, "
              f"throughput {on['request_throughput'] / off['request_throughput']:.1f}x higher")
    path = write_result("prefix", report)
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
