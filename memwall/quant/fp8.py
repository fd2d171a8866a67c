"""FP8 (E4M3) weights with one scale per output channel, for the GPU backend.

    w[n, k] ~= q[n, k] * scale[n]        q: torch.float8_e4m3fn, |q| <= 448

``apply`` picks one of three paths (``use_small_m_kernel`` decides the first):

    cuda, <= SMALL_M_MAX rows (decode)   the Triton weight-only kernel (memwall/kernels/triton/
                                         fp8_linear.py): the weight bytes streamed once, widened
                                         in registers; x stays in its dtype. Any CUDA GPU.
    cuda, compute capability >= 8.9      x quantized too, one scale per token computed on the
                                         fly ("dynamic per-token"), on ``torch._scaled_mm``:
                                         y[t, n] = sum_k xq[t, k] * q[n, k] * x_scale[t] * scale[n]
    elsewhere (the CPU, older GPUs)      the weight widened to x's dtype, then F.linear: slow,
                                         but the same stored numbers (how the CPU tests check
                                         the format)
The lm_head and embeddings stay in the compute dtype (``quantize_model(..., include_lm_head=
False)`` at the call site): the head's error lands directly on the logits.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from memwall.quant.base import (QuantLinear, QuantMethod, QuantWeights, columns_of, rows_of,
                                stack_rows)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
_ALIGN = 16  # _scaled_mm wants both matrix dims of the weight to be multiples of 16
_MIN_SCALE = 1e-12  # keeps an all-zero row or token from dividing by zero
SMALL_M_MAX = 32
"""Up to this many rows (tokens) a CUDA matmul runs the Triton weight-only kernel. There the
matmul is bound by reading the weight, and _scaled_mm paid for quantizing x in extra launches
and reached 29% of the copy rate at one token (H100), slower than bf16 weights. Above it the
work grows with the rows and fp8 tensor cores (prefill) win. 32 takes the CUDA-graph buckets
1..32 (memwall/worker/cuda_graphs.py); 64 and 128 stay on _scaled_mm until benchmarks/gpu.py's
fp8 linear rows show where the crossover really lies."""


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row FP8: x [R, K] -> (q float8_e4m3fn [R, K], scale float32 [R]).

    scale = amax(|row|) / 448, so every value lands in range; the rounding error of an element
    is at most half an E4M3 step at its magnitude (relative 2^-4 for normal numbers).
    """
    x = x.float()
    scale = (x.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)  # [R]
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [R, K]
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_fp8_rows``: [R, K] in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def scaled_mm_supported(device: torch.device) -> bool:
    """True where torch._scaled_mm has FP8 kernels: CUDA devices of compute capability >= 8.9."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def use_small_m_kernel(device_type: str, rows: int, triton_available: bool) -> bool:
    """Whether ``apply`` sends ``rows`` rows of x to the Triton kernel: on cuda with triton,
    1..SMALL_M_MAX rows, whatever the compute capability (the kernel decodes FP8 itself where
    the GPU has no FP8 units). The CPU keeps the F.linear path."""
    return device_type == "cuda" and triton_available and 1 <= rows <= SMALL_M_MAX


@lru_cache(maxsize=1)
def _small_m_kernel():
    """The Triton launcher, or None without triton: imported on the first cuda call only, so
    that a CPU process never imports triton for FP8 weights."""
    from memwall.kernels.triton import TRITON_AVAILABLE

    if not TRITON_AVAILABLE:
        return None
    from memwall.kernels.triton.fp8_linear import fp8_linear

    return fp8_linear


class Fp8Linear(QuantMethod):
    """E4M3 weights, a float32 scale per output channel; on cuda, activations quantized per
    token above SMALL_M_MAX rows, kept in their dtype at or below it."""

    name = "fp8"

    def supports(self, out_features: int, in_features: int) -> bool:
        return out_features % _ALIGN == 0 and in_features % _ALIGN == 0

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        n, k = weight.shape
        if not self.supports(n, k):
            raise ValueError(f"fp8: a {n}x{k} weight cannot be held; both dims must be multiples "
                             f"of {_ALIGN} (torch._scaled_mm's requirement)")
        q, scale = quantize_fp8_rows(weight)
        return QuantWeights(self, {"qweight": q, "wscale": scale}, out_features=n, in_features=k,
                            source="fp8 e4m3 per-channel")

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        return stack_rows(self, parts)

    def column_unit(self, layer: QuantLinear) -> int:
        return _ALIGN

    def take_rows(self, layer: QuantLinear, index: torch.Tensor) -> QuantWeights:
        return rows_of(layer, index)

    def take_columns(self, layer: QuantLinear, start: int, stop: int) -> QuantWeights:
        return columns_of(layer, start, stop, {"qweight": 1}, _ALIGN)  # wscale: one per output row

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])  # leading dims flattened
        kernel = _small_m_kernel() if x.is_cuda else None
        if use_small_m_kernel(x.device.type, rows, kernel is not None):
            return kernel(x, layer.qweight, layer.wscale)
        if scaled_mm_supported(x.device):
            return fp8_scaled_mm(x, layer.qweight, layer.wscale)
        w = dequantize_fp8_rows(layer.qweight, layer.wscale, x.dtype)  # [out, in]
        return F.linear(x, w)


def fp8_scaled_mm(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """x [T, K] (bf16/fp16/fp32 on CUDA) @ the FP8 weight [N, K] -> [T, N] in x.dtype.

    Row-wise scaling (a scale per token of x, per output channel of w) needs bf16 output in
    torch's kernel, so the result is produced in bf16 and cast back.
    """
    xq, x_scale = quantize_fp8_rows(x)  # [T, K] fp8, [T] float32
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale[:, None], scale_b=wscale[None, :],
                         out_dtype=torch.bfloat16)  # [T, N]
    return y.to(x.dtype)
