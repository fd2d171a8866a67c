"""q4/q8 matmuls with integer activations (int_gemm.c: int16 with a scale per 32 values;
int8_dot.c's two int8 digits for up to 8 tokens on AVX512-VNNI), at every batch size: their error is
the activations' rounding, and greedy decoding of the embedded model keeps to the exact path."""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import amx, build, quant_ops
from memwall.quant.base import QuantLinear
from memwall.quant.int4_cpu import NativeQ4
from memwall.quant.int8_cpu import NativeQ8

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="native kernels not built")


def _both(layer: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quant_ops.set_int_acts(False)
    exact = layer(x)
    quant_ops.set_int_acts(True)
    return exact, layer(x)


_set_int_acts = quant_ops.set_int_acts


def _int16_acts(on: bool) -> None:
    """set_int_acts with int8_tiles.c's prefill path off: the int16 kernels at every size"""
    _set_int_acts(on)
    quant_ops.set_int8_tiles(False)


@pytest.fixture(autouse=True)
def _int8_tiles_back_on():
    yield
    quant_ops.set_int8_tiles(True)


def test_int8_tiles_take_prefill_batches_of_this_format_only_when_asked():
    """This q4 format (float scales, Q4_0/Q4_1-like) stays on int16 past 16 tokens by default;
    with ``q4_float_tables`` AVX2 builds multiply it with int8 activations (a scale per 32
    values): llama.cpp's precision, ~1e-2 relative here, not int16's ~2e-5."""
    g = torch.Generator().manual_seed(4)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(32, 128, generator=g)))
    x = torch.randn(40, 128, generator=g)
    exact, fast = _both(layer, x)
    assert 0 < _rel(fast, exact) < 1e-4
    quant_ops.set_int8_tiles(True, q4_float_tables=True)
    exact, fast = _both(layer, x)
    if quant_ops.int_gemm_isa() == "c":
        assert 0 < _rel(fast, exact) < 1e-4
    else:
        assert 1e-4 < _rel(fast, exact) < 3e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("k, n", [(64, 8), (576, 960), (1536, 576)])
def test_q4_error_is_activation_rounding(k, n):
    g = torch.Generator().manual_seed(k)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(n, k, generator=g)))
    exact, fast = _both(layer, torch.randn(1, k, generator=g))
    # ~15 bits a value: ~2e-5 relative error (one int8 code alone would give ~5e-3); not zero,
    # which shows the integer path ran
    assert 0 < _rel(fast, exact) < 1e-4


@pytest.mark.parametrize("group", [16, 32, 64, 256])
def test_q8_all_group_sizes(group):
    g = torch.Generator().manual_seed(group)
    k, n = 256, 40
    q = torch.randint(-128, 128, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) + 0.1
    c = torch.randn(n, k // group, generator=g) * 0.1
    layer = QuantLinear(NativeQ8().from_codes(q, s, c, "test"))
    exact, fast = _both(layer, torch.randn(1, k, generator=g))
    assert 0 < _rel(fast, exact) < 1e-4


def test_exact_on_activations_the_integers_represent():
    """Activations that are already multiples of their block's max / 32767 quantize without
    error, so the only difference left is float summation order (nine tokens: int_gemm.c on
    every CPU, where up to eight take int8_dot.c's digits on AVX512-VNNI)."""
    g = torch.Generator().manual_seed(0)
    k, n = 128, 16
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(n, k, generator=g)))
    x = torch.randint(-32767, 32768, (9, k), generator=g).float()
    x[:, ::32] = 32767.0  # every block's max is 32767: scale exactly 1
    exact, fast = _both(layer, x)
    # terms of ~1e6 cancel to ~1e3: summation order alone moves single outputs by ~0.03, the
    # activations' rounding (test above) would move the whole by ~2e-5
    assert _rel(fast, exact) < 1e-6


@pytest.mark.parametrize("tokens", [2, 3, 8, 9, 16, 17, 31, 32, 128])
def test_batches_take_the_integer_kernels_too(tokens, monkeypatch):
    """Integer activations for every batch up to the limit, except where an AVX-512 build
    without VNNI takes its fp32 tiles (``tiles_from()``: 16 tokens a thread): those are exact.
    With VNNI, past 8 tokens, panel_gemm.c's int16 panels run (tests/kernels/test_panel_gemm.py).
    int16 here; past 16 tokens AVX2 builds take int8 for this format (test_int8_tiles.py)."""
    monkeypatch.setattr(quant_ops, "set_int_acts", _int16_acts)
    g = torch.Generator().manual_seed(tokens)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(32, 128, generator=g)))
    x = torch.randn(tokens, 128, generator=g)
    exact, fast = _both(layer, x)
    panels = build.require().mw_panel_available() and tokens > 8
    if 0 < quant_ops.tiles_from() <= tokens and not panels:
        assert torch.equal(fast, exact)
    else:
        assert 0 < _rel(fast, exact) < 1e-4


def test_past_the_integer_batch_limit_the_exact_kernels_run(monkeypatch):
    """Prefill-sized batches: dequantize + BLAS (or the AVX-512 tiles) beat the row-by-row int16
    kernels; where AMX's split bf16 is on (kernels/cpu/amx.py) it runs instead, to ~5e-6, and
    with AVX-512 VNNI the int16 panels (panel_gemm.c, 3x the fp32 tiles) at any size. (This q4
    format takes int8 activations at every size on AVX2 unless they are switched off.)"""
    monkeypatch.setattr(quant_ops, "set_int_acts", _int16_acts)
    g = torch.Generator().manual_seed(2)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(32, 128, generator=g)))
    x = torch.randn(quant_ops.INT_ACTS_MAX_TOKENS + 1, 128, generator=g)
    panels = bool(build.require().mw_panel_available())
    exact, fast = _both(layer, x)
    if amx.enabled():
        assert 0 < _rel(fast, exact) < 2e-5
    elif panels:
        assert 0 < _rel(fast, exact) < 1e-4
    else:
        assert torch.equal(exact, fast)
    monkeypatch.setattr(amx, "enabled", lambda: False)
    exact, fast = _both(layer, x)
    assert (0 < _rel(fast, exact) < 1e-4) if panels else torch.equal(exact, fast)


@torch.inference_mode()
def test_embedded_model_greedy_agrees_with_the_exact_path(gguf_path):
    from memwall.entrypoints.llm import LLM
    from memwall.sampling_params import SamplingParams

    llm = LLM(str(gguf_path), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[{"role": "user", "content": t}] for t in
               ("What is the capital of France?", "Name three primary colors.",
                "Write a haiku about autumn.")]
    quant_ops.set_int_acts(True)
    fast = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    quant_ops.set_int_acts(False)
    exact = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    quant_ops.set_int_acts(True)
    # three prompts decode as a batch of three, then one alone: both on the integer kernels
    single_fast = llm.chat(prompts[:1], params)[0].outputs[0].token_ids
    quant_ops.set_int_acts(False)
    single_exact = llm.chat(prompts[:1], params)[0].outputs[0].token_ids
    quant_ops.set_int_acts(True)
    matches = sum(a == b for f, e in zip(fast + [single_fast], exact + [single_exact])
                  for a, b in zip(f, e))
    assert matches / (32 * 4) >= 0.9
