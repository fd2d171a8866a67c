"""Pipeline parallel: each stage holds a contiguous run of layers; hidden states go from one
stage to the next; the engine core keeps one step a stage in flight (each of other requests),
so stage 0 runs step k+1 while stage 1 runs step k.

    stage 0: embed, layers [0, a)  ── hidden [T, H] ──>  stage 1: layers [a, L), norm, LM head,
                                     (a shared-memory ring      sample -> RunnerOutput
                                      per stage boundary)

Layers are split to balance each stage's weights, the LM head counted with the last stage (a
49k-row head weighs as much as 8 of SmolLM2's 30 layers; decode reads all of it every step).
Every stage receives every SchedulerOutput and keeps the same per-request rows; only the last
samples. A stage is a transformation of the loaded model (``cut_stage``), as tensor parallel is,
and composes with it: a stage's layers may be cut again across its tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from memwall.config import ModelArchConfig
from memwall.distributed.stage_split import balanced_stages

PIPE_SLOT_BYTES = 8 << 20  # a 2048-token chunk of a 1024-wide model; larger ones spill to a segment
PIPE_SLOTS = 4


@dataclass(frozen=True)
class PipelineStage:
    index: int
    size: int
    layers: tuple[int, int]
    """[start, stop) of the model's layers this stage holds."""

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def describe(self) -> str:
        extra = [w for w, on in (("embedding", self.first), ("LM head", self.last)) if on]
        return (f"pipeline stage {self.index} of {self.size}: layers {self.layers[0]}-"
                f"{self.layers[1] - 1}" + (f" + {' and '.join(extra)}" if extra else ""))


def layer_cost(arch: ModelArchConfig) -> int:
    """Weights a token reads in one decoder layer (attention projections and the MLP)."""
    d = arch.head_dim
    attn = arch.hidden_size * d * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads)
    return attn + 3 * arch.hidden_size * arch.intermediate_size


def stage_layers(arch: ModelArchConfig, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, minimizing the heaviest stage (the LM head's
    weights counted with the last); every stage gets at least one layer."""
    return balanced_stages(arch.num_hidden_layers, stages, layer_cost(arch),
                           arch.vocab_size * arch.hidden_size)


def stage_of(index: int, size: int, arch: ModelArchConfig) -> PipelineStage:
    return PipelineStage(index, size, stage_layers(arch, size)[index])


def stage_tensors(index: int, size: int):
    """For the loader (``load_model(part=...)``): given the model's arch, which checkpoint
    tensors stage ``index`` of ``size`` holds; the loader reads no others."""
    def wanted_of(arch: ModelArchConfig):
        stage = stage_of(index, size, arch)
        start, stop = stage.layers

        def wanted(name: str) -> bool:
            if name.startswith("model.layers."):
                return start <= int(name.split(".")[2]) < stop
            if name.startswith("model.embed_tokens."):  # a tied head reads the same table
                return stage.first or (stage.last and arch.tie_word_embeddings)
            if name.startswith(("lm_head.", "model.norm.")):
                return stage.last
            return True
        return wanted
    return wanted_of


def cut_stage(net: nn.Module, stage: PipelineStage) -> ModelArchConfig:
    """Keeps only ``stage``'s layers of a loaded model (the embedding on the first stage, the
    final norm and LM head on the last); returns the stage's arch (its layer count)."""
    cfg: ModelArchConfig = net.config
    start, stop = stage.layers
    inner = net.model
    inner.layers = nn.ModuleList(list(inner.layers)[start:stop])
    if not stage.first:
        inner.embed_tokens = None
    if not stage.last:
        inner.norm = None
        net.lm_head = None
    types = cfg.layer_types[start:stop] if cfg.layer_types is not None else None
    local = dataclasses.replace(cfg, num_hidden_layers=stop - start, layer_types=types)
    net.config = local
    net.pipeline_stage = stage
    return local


class StagePipe:
    """Hidden states from one stage's rank to the same tensor-parallel rank of the next:
    a one-reader shared-memory ring (memwall/distributed/shm_broadcast.py)."""

    def __init__(self, ring, sending: bool) -> None:
        self.ring, self.sending = ring, sending

    @classmethod
    def open_sender(cls) -> "StagePipe":
        from memwall.distributed.shm_broadcast import ShmBroadcast
        return cls(ShmBroadcast(1, slot_bytes=PIPE_SLOT_BYTES, n_slots=PIPE_SLOTS), True)

    @classmethod
    def connect(cls, handle) -> "StagePipe":
        from memwall.distributed.shm_broadcast import ShmBroadcast
        return cls(ShmBroadcast.attach(handle, 0), False)

    def handle(self):
        return self.ring.handle()

    def send(self, hidden: torch.Tensor, timeout: float | None = None) -> None:
        self.ring.put(hidden.detach().float().contiguous().numpy(), timeout=timeout)  # [T, H]

    def receive(self, timeout: float | None = None) -> torch.Tensor:
        array = self.ring.get(timeout=timeout)
        if not array.flags.writeable:
            array = np.array(array)
        return torch.from_numpy(array)  # [T, H] float32

    def close(self) -> None:
        self.ring.close()


class Handoff:
    """A stage boundary whose hidden states travel as a call's argument and return value
    instead of a ring (the Ray executor: Ray's object store carries them, between hosts too;
    ``Worker.execute_stage``)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def send(self, hidden: torch.Tensor, timeout: float | None = None) -> None:
        self.value = hidden.detach().float().contiguous()  # [T, H]

    def receive(self, timeout: float | None = None) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("no hidden states were handed to this pipeline stage")
        return value

    def close(self) -> None:
        self.value = None


@dataclass
class PipeEnds:
    """A stage's connections: from the previous stage (not on the first), to the next (not on
    the last)."""

    stage: PipelineStage
    incoming: StagePipe | Handoff | None = None
    outgoing: StagePipe | Handoff | None = None
    timeout_s: float | None = None
    wait_s: float = 0.0
    """Seconds spent waiting for the stage before (the pipeline's bubble, seen from here)."""

    def receive(self) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self.incoming.receive(self.timeout_s)
        finally:
            self.wait_s += time.perf_counter() - start

    def send(self, hidden: torch.Tensor) -> None:
        self.outgoing.send(hidden, self.timeout_s)

    def close(self) -> None:
        for pipe in (self.incoming, self.outgoing):
            if pipe is not None:
                pipe.close()


__all__ = ["PipelineStage", "stage_layers", "cut_stage", "StagePipe", "Handoff", "PipeEnds",
           "layer_cost"]
