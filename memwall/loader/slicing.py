"""Reading part of a checkpoint tensor: what a tensor-parallel rank's loader asks for.

A ``ShardLayout`` (memwall/distributed/tensor_parallel.py builds one per rank) says which model
the process builds (its heads, KV heads, MLP columns and vocabulary rows) and, by tensor name,
which ``TensorSlice`` of each checkpoint tensor fills it. The readers (GGUF quantized blocks,
GGUF floats, safetensors) read only those rows and columns from the file, so a rank's peak
memory and bytes read are its share of the model, not the whole of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from memwall.config import ModelArchConfig


@dataclass(frozen=True)
class TensorSlice:
    """Rows (dim 0: [start, stop) ranges, joined in order; None: all) and columns (dim 1 of a
    2-D tensor: one [start, stop) range; None: all) of a tensor in its Hugging Face layout."""

    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None

    def row_index(self, total: int) -> np.ndarray:
        if self.rows is None:
            return np.arange(total, dtype=np.int64)
        for start, stop in self.rows:
            if not 0 <= start < stop <= total:
                raise ValueError(f"rows {start}..{stop} of a tensor of {total} rows")
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.rows])

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """This slice of a tensor already in memory (a bias, a norm: read whole, they are tiny)."""
        if self.rows is not None:
            t = torch.cat([t[a:b] for a, b in self.rows])
        if self.cols is not None:
            t = t[:, self.cols[0]:self.cols[1]]
        return t.contiguous()

    def read_safetensors(self, part: Any) -> torch.Tensor:
        """This slice of a safetensors ``get_slice`` handle: only these bytes leave the file."""
        cols = slice(None) if self.cols is None else slice(*self.cols)
        rows = [slice(None)] if self.rows is None else [slice(a, b) for a, b in self.rows]
        if len(part.get_shape()) == 1:
            return torch.cat([part[r] for r in rows])
        return torch.cat([part[r, cols] for r in rows]).contiguous()


class ShardLayout(Protocol):
    """What one tensor-parallel rank loads."""

    arch: ModelArchConfig
    """The model this process builds: the rank's heads, KV heads, MLP width and vocabulary rows."""

    def slice_of(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor ``name`` (HF name) this rank holds; None: all of it."""
        ...


__all__ = ["TensorSlice", "ShardLayout"]
