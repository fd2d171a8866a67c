"""LoRAAdapter: one adapter's weights as memwall computes with them, whatever file they came from.

    y = x @ W^T + (x @ A^T) @ B^T * scaling        A [r, in], B [out, r]

``modules`` is keyed by the base model's Hugging Face module names
(``model.layers.3.self_attn.q_proj``); B already carries the scaling (alpha / r, or
alpha / sqrt(r) for rsLoRA), so every consumer applies ``x @ A^T @ B^T`` and nothing else.
The PEFT loader (peft.py) and the GGUF loader (gguf_lora.py) both produce this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (attention and MLP of every decoder layer)."""

_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


class LoRAError(ValueError):
    """An adapter memwall cannot serve; the message says why (the server answers 400)."""


@dataclass(frozen=True)
class LoRAWeights:
    a: torch.Tensor
    """[r, in] float32"""
    b: torch.Tensor
    """[out, r] float32, scaling folded in"""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    content_hash: str
    """sha256 of the adapter's files as read: the prefix-cache namespace (never the name, so a
    reloaded adapter with new weights never meets its old KV blocks)."""
    rank: int
    modules: dict[str, LoRAWeights] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * 4 + w.b.numel() * 4 for w in self.modules.values())

    def layer_target(self, module: str) -> tuple[int, str]:
        """``model.layers.3.self_attn.q_proj`` -> (3, "q_proj")."""
        match = _MODULE.match(module)
        if match is None or match.group(3) not in TARGETS:
            raise LoRAError(f"adapter {self.name!r}: module {module!r} is not a target memwall "
                            f"serves ({', '.join(TARGETS)} of model.layers.N)")
        return int(match.group(1)), match.group(3)
