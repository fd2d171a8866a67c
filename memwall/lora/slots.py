"""LoRASlots: the resident adapters' weights, in the one layout the torch path and decode.c read.

For every decoder layer and target projection there is one ``SlotSegment``:

    a    [max_loras, max_rank, in]   float32   slot s, rank rows 0..rank[s]-1 used
    bt   [max_loras, max_rank, out]  float32   B^T with the adapter's scaling folded in
    rank [max_loras]                 int32     0: the slot's adapter does not target it

A segment also says where its output columns sit in the projection that computes it
(``col``): q/k/v share the fused qkv projection, gate/up the fused gate_up one. Rows past a
slot's rank are never read, so an adapter of rank 8 in slots sized for 64 costs rank 8.

Each step the runner says which slot each token uses (``set_step``; -1: no adapter); the
``LoRAProjection`` modules (layers.py) and the fused CPU decode step read that mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memwall.config import ModelArchConfig
from memwall.lora.adapter import LoRAAdapter, LoRAError

PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
"""decode.c's projections and the targets whose outputs sit side by side in each."""


@dataclass
class SlotSegment:
    target: str
    col: int
    """First output column of this target in its (possibly fused) projection."""
    a: torch.Tensor
    bt: torch.Tensor
    rank: torch.Tensor

    @property
    def n(self) -> int:
        return self.bt.shape[2]

    @property
    def k(self) -> int:
        return self.a.shape[2]


def target_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """target -> (in, out) features."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def base_config(arch: ModelArchConfig) -> dict:
    """The HF-style head counts a GGUF LoRA needs to undo llama.cpp's q/k row permutation
    (``load_adapter``'s ``base_config``)."""
    return {"num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads}


class LoRASlots:
    def __init__(self, arch: ModelArchConfig, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        self.arch, self.max_loras, self.max_rank = arch, max_loras, max_rank
        self.shapes = target_shapes(arch)
        self.layers: list[dict[str, SlotSegment]] = []
        for _ in range(arch.num_hidden_layers):
            segs: dict[str, SlotSegment] = {}
            for targets in PROJECTIONS.values():
                col = 0
                for target in targets:
                    k, n = self.shapes[target]
                    segs[target] = SlotSegment(
                        target, col, torch.zeros(max_loras, max_rank, k),
                        torch.zeros(max_loras, max_rank, n),
                        torch.zeros(max_loras, dtype=torch.int32))
                    col += n
            self.layers.append(segs)
        self.token_slots: torch.Tensor | None = None
        """This step's slot per token (int32 [T], -1 none), or None: no token uses an adapter."""
        self.groups: list[tuple[int, torch.Tensor]] = []
        """This step's (slot, token indexes) per slot in use."""

    def segments(self, layer: int, projection: str) -> list[SlotSegment]:
        """The segments of decode.c's projection ``qkv``, ``o``, ``gate_up`` or ``down``."""
        return [self.layers[layer][t] for t in PROJECTIONS[projection]]

    def check(self, adapter: LoRAAdapter) -> None:
        check_adapter(adapter, self.arch, self.max_rank)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies ``adapter`` into ``slot`` (every segment it does not target gets rank 0)."""
        self.check(adapter)
        self.clear(slot)
        for module, w in adapter.modules.items():
            layer, target = adapter.layer_target(module)
            seg, r = self.layers[layer][target], w.a.shape[0]
            seg.a[slot, :r].copy_(w.a)
            seg.bt[slot, :r].copy_(w.b.t())
            seg.rank[slot] = r

    def clear(self, slot: int) -> None:
        for segs in self.layers:
            for seg in segs.values():
                seg.rank[slot] = 0

    def set_step(self, token_slots: list[int] | None) -> None:
        """The slot of each token of the step's flat token axis (-1: base model only)."""
        if token_slots is None or all(s < 0 for s in token_slots):
            self.token_slots, self.groups = None, []
            return
        t = torch.tensor(token_slots, dtype=torch.int32)
        self.token_slots = t
        self.groups = [(s, (t == s).nonzero().flatten()) for s in sorted(set(token_slots)) if s >= 0]


def check_adapter(adapter: LoRAAdapter, arch: ModelArchConfig, max_rank: int) -> None:
    """LoRAError unless ``adapter`` fits this model and slots of ``max_rank``."""
    if adapter.rank > max_rank:
        raise LoRAError(f"adapter {adapter.name!r} has rank {adapter.rank}, above "
                        f"--max-lora-rank {max_rank}")
    shapes = target_shapes(arch)
    for module, w in adapter.modules.items():
        layer, target = adapter.layer_target(module)
        if layer >= arch.num_hidden_layers:
            raise LoRAError(f"adapter {adapter.name!r}: {module} is past the model's "
                            f"{arch.num_hidden_layers} layers")
        k, n = shapes[target]
        r = w.a.shape[0]
        if tuple(w.a.shape) != (r, k) or tuple(w.b.shape) != (n, r):
            raise LoRAError(f"adapter {adapter.name!r}: {module} has lora_A {list(w.a.shape)} "
                            f"and lora_B {list(w.b.shape)}; this model needs [r, {k}] and "
                            f"[{n}, r]")
