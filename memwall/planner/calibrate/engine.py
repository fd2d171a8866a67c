"""The engine's own time for the calibration's ``host_s``: tiny models (memwall/loader/
synthetic.py: TINY_WIDTH wide, TINY_LAYERS layers, the embedded tokenizer) served by the real
engine, whose steps are nearly all overhead, timed as benchmarks/cpu.py times steps; less what
the roofline counts of them, a fixed cost per step and one per layer remain:

    decode   t(L) = decode_step + L x decode_layer       (scheduling, inputs, sampling,
                                                          detokenizing; decode.c's launches)
    prefill  t(L) = prefill_step + L x prefill_layer     (a TINY_PROMPT-token chunk through
                                                          the torch path's per-op costs)

The two models are served side by side and timed in turns, so that a machine whose speed
drifts moves both alike.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from memwall.planner.calibrate.kernels import two_point

TINY_WIDTH, TINY_FFN, TINY_HEADS = 128, 256, 2
TINY_LAYERS = (1, 5)
TINY_PROMPT = 32  # its matmuls, attention and elementwise work are a few percent of its time


def tiny_timings(threads: int, quick: bool) -> dict:
    """{"decode": {L: s}, "prefill": {L: s}, "head_s": s}: medians of the tiny models' decode
    steps and prefills, and their LM head alone."""
    from memwall import LLM
    from memwall.loader import synthetic

    with tempfile.TemporaryDirectory(prefix="memwall-calibrate-") as tmp, _quiet():
        fields = synthetic.tokenizer_fields()
        engines = {layers: LLM(str(synthetic.write(
            Path(tmp) / f"tiny-{layers}.gguf", TINY_WIDTH, layers, TINY_HEADS, 1, TINY_FFN,
            tokenizer=fields)), threads=threads, max_model_len=1024, num_kv_blocks=64,
            max_num_batched_tokens=1024, prefix_caching=False) for layers in TINY_LAYERS}
        decode = {layers: [] for layers in engines}
        prefill = {layers: [] for layers in engines}
        head: list[float] = []
        for turn in range(3 if quick else 4):
            for layers, llm in engines.items():
                decode[layers] += _decode_steps(llm, 8 if quick else 16)
                prefill[layers] += [_prefill_s(llm, 3 * turn + i) for i in range(3)]
            head += _head_s(engines[TINY_LAYERS[0]], 3)
    return {"decode": {k: statistics.median(v) for k, v in decode.items()},
            "prefill": {k: statistics.median(v[1:]) for k, v in prefill.items()},
            "head_s": statistics.median(head)}


def _head_s(llm, calls: int) -> list[float]:
    """Seconds of the served model's own LM head on one token, ``calls`` times: the layer the
    steps run, not a stand-in matmul (a generic q8 matmul took 0.8-1.3 ms on a Cascade Lake
    Xeon where the whole 1-layer decode step took 1.05 ms, and the steps' intercept went
    negative)."""
    model = llm.engine.core.executor.worker.runner.model
    x = torch.randn(1, TINY_WIDTH)
    with torch.inference_mode():
        model.compute_logits(x)  # warm
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            model.compute_logits(x)
            times.append(time.perf_counter() - start)
        return times


@contextlib.contextmanager
def _quiet():
    """The engine's start-up lines would drown the table."""
    logger = logging.getLogger("memwall")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _decode_steps(llm, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of one request (after its prefill)."""
    from memwall import SamplingParams

    engine = llm.engine
    engine.add_request("decode", list(range(10, 26)),
                       SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 1))
    engine.step()  # prefill and first token
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _prefill_s(llm, seed: int) -> float:
    """Seconds of one TINY_PROMPT-token prompt's prefill and first token."""
    from memwall import SamplingParams

    prompt = [(seed * 7 + t) % 1000 + 10 for t in range(TINY_PROMPT)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - start


def host_figures(tiny: dict, figures: dict) -> dict[str, float]:
    """host_s from the tiny models' timings less what the roofline counts of them (their LM
    head's matmul, measured alone; a prefill's matmuls, attention and elementwise work, at the
    kernel ``figures`` measured), a line through the two layer counts."""
    width, n = TINY_WIDTH, TINY_PROMPT
    d = width // TINY_HEADS
    layer_params = width * (TINY_HEADS + 2) * d + width * width + 3 * width * TINY_FFN
    per_layer = (2 * n * layer_params / figures["matmul_flops"]["int8_prefill"]  # <= 128 tokens
                 + 4 * width * n * (n + 1) / 2 / figures["attention_flops"]
                 + n * (width + TINY_FFN) * figures["layer_value_s"])
    l1, l2 = TINY_LAYERS
    head_s = tiny["head_s"]
    decode_step, decode_layer = two_point((l1, l2), (tiny["decode"][l1], tiny["decode"][l2]))
    prefill_step, prefill_layer = two_point(
        (l1, l2), tuple(tiny["prefill"][layers] - layers * per_layer - head_s
                        for layers in (l1, l2)))
    return {"decode_step": max(0.0, decode_step - head_s), "decode_layer": decode_layer,
            "prefill_step": prefill_step, "prefill_layer": prefill_layer,
            "prefill_value_layer": figures["layer_value_s"]}
