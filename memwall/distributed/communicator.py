"""Communicator: the collectives a tensor-parallel rank needs, over whichever transport joins
its group.

    ShmCommunicator    ranks on one host: a shared-memory segment (shm_comm.c), microseconds
                       a call, callable from the fused C decode step without Python
    GlooCommunicator   any hosts: torch.distributed's gloo (1-2 ms a call between two local
                       processes: correct everywhere, fast nowhere)
    (NCCL on CUDA is torch.distributed with backend "nccl": GlooCommunicator's code with
    another backend name, for a session with GPUs.)

Every rank calls the same collectives in the same order (they run the same steps), and every
rank gets bit-identical results: the shared-memory sum adds the ranks in rank order on each.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from datetime import timedelta

import torch


class Communicator(ABC):
    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks (same shape and dtype)."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``t`` [..., sizes[rank]] of every rank side by side along the last dim, in rank
        order -> [..., sum(sizes)] (a vocab-parallel head's logits)."""

    def native_all_reduce(self) -> tuple[int, int] | None:
        """(address of ``int fn(void* ctx, float* buf, int64 n)``, ctx) summing ``buf`` over
        the ranks in place, for the fused decode step; None where there is none."""
        return None

    def abort(self) -> None:
        """Wakes every rank waiting in a collective with an error (a rank died)."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__


class ShmCommunicator(Communicator):
    """Ranks on one host: ``memwall.distributed.shm_comm.ShmGroup``."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.size = group.rank, group.world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.is_contiguous():
            return self.group.all_reduce(t)
        summed = self.group.all_reduce(t.float().contiguous())
        return summed.to(t.dtype)

    def all_gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        flat = t.float().contiguous().reshape(-1, t.shape[-1])  # [rows, sizes[rank]]
        out = self.group.all_gather(flat, sizes)  # [rows, sum(sizes)]
        return out.reshape(*t.shape[:-1], sum(sizes)).to(t.dtype)

    def native_all_reduce(self) -> tuple[int, int]:
        return self.group.c_function(), self.group.c_context()

    def abort(self) -> None:
        self.group.abort()

    def close(self) -> None:
        self.group.close()

    def describe(self) -> str:
        return "shared-memory all-reduce"


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_ABORTED = -8  # MW_COMM_ABORTED (kernels.h)


class GlooCommunicator(Communicator):
    """torch.distributed over a process group (gloo on CPU, for ranks on other hosts)."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._callback = _CALLBACK(self._c_all_reduce)  # kept: C holds its address

    @classmethod
    def init(cls, address: str, rank: int, size: int, timeout_s: float,
             backend: str = "gloo") -> "GlooCommunicator":
        """Joins (or, rank 0, opens) the group at ``address`` ("host:port")."""
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank,
                                    world_size=size, timeout=timedelta(seconds=timeout_s))
        return cls(None, rank, size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        import torch.distributed as dist
        widest = max(sizes)
        padded = torch.nn.functional.pad(t.contiguous(), (0, widest - t.shape[-1]))
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def _c_all_reduce(self, ctx, buf, n) -> int:
        try:
            view = (ctypes.c_float * n).from_address(buf)
            self.all_reduce(torch.frombuffer(view, dtype=torch.float32))
            return 0
        except Exception:  # the C step reports it as an aborted collective
            return _ABORTED

    def native_all_reduce(self) -> tuple[int, int]:
        return ctypes.cast(self._callback, ctypes.c_void_p).value, 0

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()

    def describe(self) -> str:
        return "gloo all-reduce"


__all__ = ["Communicator", "ShmCommunicator", "GlooCommunicator"]
