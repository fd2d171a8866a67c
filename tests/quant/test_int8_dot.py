"""One-token matmuls with activations as two int8 digits and VNNI dot products (decode.c):
their error is the low digit's rounding, and greedy decoding of the embedded model keeps to
the exact path."""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import quant_ops
from memwall.quant.base import QuantLinear
from memwall.quant.int4_cpu import NativeQ4
from memwall.quant.int8_cpu import NativeQ8

pytestmark = pytest.mark.skipif(not quant_ops.int8_dot_available(),
                                reason="needs the native kernels on a CPU with AVX512-VNNI")


def _both(layer: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quant_ops.set_int8_dot(False)
    exact = layer(x)
    quant_ops.set_int8_dot(True)
    return exact, layer(x)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("k, n", [(64, 8), (576, 960), (1536, 576)])
def test_q4_int8_dot_error_is_activation_rounding(k, n):
    g = torch.Generator().manual_seed(k)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(n, k, generator=g)))
    exact, fast = _both(layer, torch.randn(1, k, generator=g))
    # two int8 digits a value: ~2e-5 relative error (one digit alone would give ~5e-3); not
    # zero, which shows the int8 path ran
    assert 0 < _rel(fast, exact) < 1e-4


@pytest.mark.parametrize("group", [16, 32, 64, 256])
def test_q8_int8_dot_all_group_sizes(group):
    g = torch.Generator().manual_seed(group)
    k, n = 256, 40
    q = torch.randint(-128, 128, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) + 0.1
    c = torch.randn(n, k // group, generator=g) * 0.1
    layer = QuantLinear(NativeQ8().from_codes(q, s, c, "test"))
    exact, fast = _both(layer, torch.randn(1, k, generator=g))
    assert 0 < _rel(fast, exact) < 1e-4


def test_int8_dot_is_exact_on_int8_representable_activations():
    """Activations that are already multiples of their block's max / 127 quantize without
    error, so the only difference left is float summation order."""
    g = torch.Generator().manual_seed(0)
    k, n = 128, 16
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(n, k, generator=g)))
    x = torch.randint(-127, 128, (1, k), generator=g).float()
    x[0, ::32] = 127.0  # every block's max is 127: scale exactly 1
    exact, fast = _both(layer, x)
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-4)


def test_batches_keep_the_exact_kernels():
    g = torch.Generator().manual_seed(1)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(32, 128, generator=g)))
    x = torch.randn(3, 128, generator=g)
    exact, fast = _both(layer, x)
    assert torch.equal(exact, fast)


@torch.inference_mode()
def test_embedded_model_greedy_agrees_with_the_exact_path(gguf_path):
    from memwall.entrypoints.llm import LLM
    from memwall.sampling_params import SamplingParams

    llm = LLM(str(gguf_path), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[{"role": "user", "content": t}] for t in
               ("What is the capital of France?", "Name three primary colors.",
                "Write a haiku about autumn.")]
    quant_ops.set_int8_dot(True)
    fast = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    quant_ops.set_int8_dot(False)
    exact = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    quant_ops.set_int8_dot(True)
    # three prompts decode as a batch (rows > 1 keep the fp32 kernels but the LM head of the
    # first token is one row); a batch of one runs every projection on the int8 path
    single_fast = llm.chat(prompts[:1], params)[0].outputs[0].token_ids
    quant_ops.set_int8_dot(False)
    single_exact = llm.chat(prompts[:1], params)[0].outputs[0].token_ids
    quant_ops.set_int8_dot(True)
    matches = sum(a == b for f, e in zip(fast + [single_fast], exact + [single_exact])
                  for a, b in zip(f, e))
    assert matches / (32 * 4) >= 0.9
