"""Whole-engine GPU benchmark (issue 7), called by benchmarks/gpu.py after the kernel cases.

One run measures, on a random-weight Llama-3-8B shape (32 layers, hidden 4096, 32 query / 8 KV
heads of 128, intermediate 14336, vocab 128256; weights never trained, so only speed means
anything here):

    decode tok/s    LLMEngine, B = 1 / 64 / 128 requests of 128 random prompt tokens and 128
                    output tokens (ignore_eos); only steps after every request has its first
                    token count, so prefill is excluded; bf16 and fp8 weights, CUDA graphs on
    roofline        bytes a decode step must read (every Linear weight + the KV of every
                    sequence) / step time, as % of the measured copy bandwidth
    prefill         one 8192-token prompt in one step: TFLOP/s (2 x params x tokens + causal
                    attention) against the measured bf16 matmul rate
    HF baseline     transformers generate, eager with its default dynamic cache, same shape and
                    dtype, B = 1 and 64 (its static cache compiles the step with torch.compile,
                    which ran 1.5 s a step on an H100 with transformers 5.17 on 2026-11-26):
                    (time for 128 new tokens - time for 1) / 127 steps
    fp8 agreement   a tiny random model with peaked logits: greedy tokens of fp8 weights (and
                    of an fp8 KV cache) vs bf16, share of positions before the first mismatch

``--smoke`` runs every piece at a tiny shape on whatever device there is (the CPU included)
to prove the code paths; its numbers are not measurements of anything.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass

import torch

from memwall.config import EngineArgs, ModelArchConfig
from memwall.engine.llm_engine import LLMEngine
from memwall.loader.model_loader import LoadedModel
from memwall.models.registry import build_model
from memwall.sampling_params import SamplingParams

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
ROPE_LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    shape: dict
    batches: tuple[int, ...]
    prompt_len: int
    output_len: int
    prefill_len: int
    hf_batches: tuple[int, ...]
    init_std: float = 0.02

    @classmethod
    def make(cls, quick: bool, smoke: bool) -> "Plan":
        if smoke:
            return cls(TINY, (1, 4), 16, 8, 64, (1, 4))
        if quick:
            return cls(LLAMA3_8B, (1, 64), 128, 32, 8192, (1,))
        return cls(LLAMA3_8B, (1, 64, 128), 128, 128, 8192, (1, 64))


def arch_of(shape: dict, max_positions: int) -> ModelArchConfig:
    return ModelArchConfig(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                           max_position_embeddings=max_positions, tie_word_embeddings=False,
                           rope_scaling=ROPE_LLAMA31, bos_token_id=None, eos_token_id=None, **shape)


def word_tokenizer(vocab_size: int):
    """A tokenizer whose token i is the word "t{i}": the engine detokenizes, ids are random."""
    import tokenizers

    from memwall.tokenizer.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return Tokenizer(backend, bos_token_id=None, eos_token_id=None, add_bos_token=False,
                     chat_template=None)


@torch.inference_mode()
def random_model(arch: ModelArchConfig, dtype: torch.dtype, device: str, std: float, seed: int = 0):
    """The model with N(0, std) weights and unit norms, built directly on ``device``."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_model(arch)
    model = model.to(dtype).to_empty(device=device)
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name else p.normal_(0.0, std)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    with torch.device(device):  # the fused Linears are created on the default device
        model.fuse_projections()
    return model.eval()


def make_engine(model, arch, device: str, dtype: str, max_seqs: int, max_len: int,
                budget: int, **kwargs) -> LLMEngine:
    args = EngineArgs(model="random", device=device, dtype=dtype, max_num_seqs=max_seqs,
                      max_model_len=max_len, max_num_batched_tokens=budget, **kwargs)
    return LLMEngine.from_args(args, LoadedModel(model, arch, word_tokenizer(arch.vocab_size), "random"))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- memwall ------------------------------------------------------------------------------------
def decode_run(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """B requests at once; times the steps after every request has its first token."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)], params)
    counts = dict.fromkeys(ids, 0)
    t0 = tokens0 = None
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if t0 is None and all(counts.values()):
            sync("cuda" if torch.cuda.is_available() else "cpu")
            t0, tokens0 = time.perf_counter(), sum(counts.values())
        elif t0 is not None:
            steps += 1
    elapsed = time.perf_counter() - t0
    decoded = sum(counts.values()) - tokens0
    return {"batch": batch, "decode_tokens": decoded, "steps": steps, "seconds": elapsed,
            "tok_per_s": decoded / elapsed, "ms_per_step": 1000 * elapsed / max(steps, 1)}


def prefill_run(engine: LLMEngine, tokens: int, flops: float) -> dict:
    rng = random.Random(1)
    engine.add_request("prefill", [rng.randrange(engine.vocab_size) for _ in range(tokens)],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "tok_per_s": tokens / seconds,
            "TFLOPs": flops / seconds / 1e12}


def linear_bytes(model: torch.nn.Module) -> int:
    """Weights a decode step reads in full: every Linear (float or quantized), lm_head included;
    not the embedding table, of which a step gathers a few rows."""
    from memwall.quant.base import QuantLinear

    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, QuantLinear):
            total += module.weight_nbytes()
    return total


def kv_bytes_per_token(arch: ModelArchConfig, kv_dtype_bytes: int) -> int:
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * kv_dtype_bytes


def prefill_flops(arch: ModelArchConfig, tokens: int) -> float:
    a = arch
    per_token = 2 * (a.hidden_size * (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
                     + a.num_attention_heads * a.head_dim * a.hidden_size
                     + 3 * a.hidden_size * a.intermediate_size) * a.num_hidden_layers
    attention = 4.0 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * tokens * (tokens + 1) / 2
    return per_token * tokens + attention + 2.0 * a.hidden_size * a.vocab_size  # logits: one row


def engine_cases(model, arch, plan: Plan, device: str, dtype: str, copy_GBps: float | None,
                 **kwargs) -> dict:
    max_len = max(plan.prefill_len + 8, plan.prompt_len + plan.output_len)
    engine = make_engine(model, arch, device, dtype, max(plan.batches), max_len,
                         max(plan.prefill_len, 2048), **kwargs)
    runner = engine.core.executor.worker.runner
    weights = linear_bytes(runner.model)
    kv_elem = runner.kv_caches[0][0].element_size()
    result = {"setup": engine.describe(), "weight_bytes_read_per_step": weights, "decode": []}
    decode_run(engine, 1, plan.prompt_len, 4, seed=99)  # warm-up: first-use costs
    for batch in plan.batches:
        row = decode_run(engine, batch, plan.prompt_len, plan.output_len, seed=batch)
        mean_ctx = plan.prompt_len + plan.output_len / 2
        step_bytes = weights + batch * mean_ctx * kv_bytes_per_token(arch, kv_elem)
        row["GBps"] = step_bytes / (row["ms_per_step"] / 1000) / 1e9
        row["roofline_pct"] = 100 * row["GBps"] / copy_GBps if copy_GBps else None
        result["decode"].append(row)
    result["prefill"] = prefill_run(engine, plan.prefill_len, prefill_flops(arch, plan.prefill_len))
    del engine
    free(device)
    return result


# ---- HF transformers baseline -------------------------------------------------------------------
def hf_baseline(plan: Plan, device: str, dtype: torch.dtype) -> list[dict]:
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in plan.shape.items()}, rms_norm_eps=1e-5,
                                   rope_theta=500000.0, rope_scaling=ROPE_LLAMA31,
                                   max_position_embeddings=131072, tie_word_embeddings=False,
                                   initializer_range=plan.init_std)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).eval()
    rows = []
    for batch in plan.hf_batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, plan.prompt_len), device=device)

        def gen(new: int) -> float:
            sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)
            sync(device)
            return time.perf_counter() - start

        gen(2)  # warm-up
        first, full = gen(1), gen(plan.output_len)
        steps = plan.output_len - 1
        rows.append({"batch": batch, "seconds_decode": full - first,
                     "tok_per_s": batch * steps / (full - first),
                     "ms_per_step": 1000 * (full - first) / steps})
    del model
    free(device)
    return rows


# ---- fp8 greedy agreement -----------------------------------------------------------------------
def _embedded_bf16():
    from memwall.loader.model_loader import load_model
    try:
        return load_model(None, "bfloat16", quantization="none")
    except Exception:  # not installed on this machine: the caller falls back to a random model
        return None


TEXTS = ["The capital of France is", "def fibonacci(n):", "Memory bandwidth limits decoding because",
         "Once upon a time, in a small village,", "The three laws of thermodynamics are",
         "To make a good cup of tea, first", "In 1969, the first humans", "A hash table stores"]


def agreement(device: str, trained: bool, prompts: int = 8, tokens: int = 32) -> dict:
    """Greedy tokens of fp8 weights / fp8 KV vs bf16 on the same weights: the embedded trained
    SmolLM2-135M when ``trained`` and installed (meaningful), else a tiny random model."""
    loaded = _embedded_bf16() if trained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    if loaded is not None:
        batch = [loaded.tokenizer.encode(t) for t in TEXTS[:prompts]]
        source = loaded.name
    else:
        rng = random.Random(5)
        batch = [[rng.randrange(TINY["vocab_size"]) for _ in range(rng.randrange(8, 40))]
                 for _ in range(prompts)]
        source = "tiny random model"

    def run(**kwargs) -> list[list[int]]:
        if loaded is not None:
            fresh = _embedded_bf16()  # fp8 quantizes in place: every run gets its own copy
            engine = make_engine(fresh.model, fresh.arch, device, "bfloat16", prompts, 256, 2048,
                                 **kwargs)
        else:
            arch = arch_of(TINY, 1024)
            model = random_model(arch, torch.bfloat16, device, std=0.25, seed=3)
            engine = make_engine(model, arch, device, "bfloat16", prompts, 256, 2048, **kwargs)
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = o.outputs[0].token_ids
        return [out[str(i)] for i in range(prompts)]

    ref = run()
    result = {"model": source}
    for name, kwargs in (("fp8_weights", {"quantization": "fp8"}), ("fp8_kv", {"kv_cache_dtype": "fp8"})):
        got = run(**kwargs)
        prefix = [next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
        result[name] = {"prefix_agreement": sum(prefix) / (prompts * tokens),
                        "exact_sequences": sum(p == tokens for p in prefix) / prompts}
    free(device)
    return result


def run(quick: bool = False, smoke: bool = False, copy_GBps: float | None = None) -> dict:
    """Everything above, on cuda when there is one (smoke: also on the CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = Plan.make(quick, smoke)
    arch = arch_of(plan.shape, 131072)
    dtype_name = "bfloat16" if device == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    result = {"device": device, "plan": plan.__dict__, "engine": {}}
    model = random_model(arch, dtype, device, plan.init_std)
    result["engine"]["bf16" if device == "cuda" else "float32"] = engine_cases(
        model, arch, plan, device, dtype_name, copy_GBps)
    # the same weights, quantized in place by the engine
    result["engine"]["fp8"] = engine_cases(model, arch, plan, device, dtype_name, copy_GBps,
                                           quantization="fp8")
    del model
    free(device)
    result["hf"] = hf_baseline(plan, device, dtype)
    result["fp8_agreement"] = agreement(device, trained=not smoke)
    return result


def print_engine(result: dict) -> None:
    for name, res in result["engine"].items():
        print(f"\n[{name}] {res['setup']}")
        for r in res["decode"]:
            roof = f"{r['roofline_pct']:.1f}%" if r["roofline_pct"] is not None else "-"
            print(f"  decode B={r['batch']:<4} {r['tok_per_s']:10.1f} tok/s  {r['ms_per_step']:8.2f} "
                  f"ms/step  {r['GBps']:7.0f} GB/s  roofline {roof}")
        p = res["prefill"]
        print(f"  prefill {p['tokens']} tokens: {p['seconds'] * 1000:.0f} ms, {p['TFLOPs']:.1f} TFLOP/s")
    for r in result["hf"]:
        print(f"[HF transformers, eager] decode B={r['batch']:<4} {r['tok_per_s']:10.1f} tok/s  "
              f"{r['ms_per_step']:8.2f} ms/step")
    agree = dict(result["fp8_agreement"])
    source = agree.pop("model")
    for name, a in agree.items():
        print(f"[{source}: {name} vs bf16] greedy prefix agreement {a['prefix_agreement']:.3f}, "
              f"identical sequences {a['exact_sequences']:.3f}")
