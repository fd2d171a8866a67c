"""RMSNorm, computed in float32 like the reference implementations, then cast back.

float32 CPU activations go through memwall/kernels/cpu/elementwise.c (one pass a row; the
residual add before a norm fused in); anything else through torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memwall.kernels.cpu import elementwise


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and elementwise.usable(x, self.weight):
            return elementwise.rms_norm(x, self.weight, self.eps)[0]
        # One fused op instead of five: decode runs two norms per layer per token.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a layer's residual add and the next norm in
        one pass (x and residual are left as they are)."""
        if (x.is_contiguous() and residual.is_contiguous()
                and elementwise.usable(x, residual, self.weight)):
            return elementwise.rms_norm(x, self.weight, self.eps, residual=residual)
        summed = x + residual
        return self.forward(summed), summed
