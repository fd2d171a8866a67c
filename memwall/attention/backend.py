"""Attention backends behind one small ABC. The runner picks one (``choose``), builds each step's
metadata with it, and binds it into the model's attention modules once (``bind``):

    torch   the readable reference (memwall/attention/paged_torch.py): the oracle the others
            are tested against; pure torch, any device
    cpu     one-token rows through the native paged decode kernel and prefill chunks through
            the native prefill kernel where the build has it (AVX-512; else the reference's),
            both in memwall/kernels/cpu/paged_attention.c, reading KV blocks in place
    triton  the GPU kernels (memwall/attention/triton_backend.py), imported only when chosen

The KV cache's number format (memwall/attention/kv_quant.py: fp32, fp16, bf16, fp8, int8 with
a scale per 16 values of a token and head) is the cache tensor's dtype. The torch and cpu
backends write and read every format (the cpu backend's native kernel reads them in place,
dequantizing in registers); triton takes the compute dtype and fp8 only (memwall/worker/device.py checks).
fp8 values are clamped to +-448 (no scale: the cache holds the values themselves).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import numpy as np
import torch

from memwall.attention import kv_quant, paged_torch
from memwall.attention.metadata import (AttentionMetadata, CpuAttentionMetadata,
                                        TorchAttentionMetadata, TritonAttentionMetadata)

BACKENDS = ("torch", "cpu", "triton")
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


class AttentionBackend(ABC):
    name: str
    metadata_type: type[AttentionMetadata]

    def build_metadata(self, query_lens: np.ndarray, seq_lens: np.ndarray,
                       block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                       block_size: int) -> AttentionMetadata:
        """One step's metadata (block_tables [S, W] and slot_mapping [T] already on the device)."""
        return self.metadata_type.from_arrays(query_lens, seq_lens, block_tables, slot_mapping,
                                              block_size, self.name)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] -> their slots (``meta.slot_mapping``), in
        the cache's format."""
        self._write(k_cache, v_cache, k, v, meta)

    @abstractmethod
    def _write(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. ``window``: a
        sliding layer's window; ``softcap``: scores capped by tanh (Gemma)."""


class TorchBackend(AttentionBackend):
    name = "torch"
    metadata_type = TorchAttentionMetadata

    def _write(self, k_cache, v_cache, k, v, meta) -> None:
        paged_torch.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale, window=window,
                                           softcap=softcap)


class CpuBackend(TorchBackend):
    """The reference with its one-token rows in C (float32 queries; any KV format, read where
    it lies)."""

    name = "cpu"
    metadata_type = CpuAttentionMetadata

    def _write(self, k_cache, v_cache, k, v, meta) -> None:
        """Through the C writer the fused decode step uses (byte for byte kv_quant.write's
        result): torch's index_copy_ into a half-precision cache took 4% of a prefill."""
        if k.dtype == torch.float32 and k_cache.dtype in kv_quant.NATIVE_CODES:
            from memwall.kernels.cpu.decode import kv_write
            kv_write(k_cache, k, meta.slot_mapping)
            kv_write(v_cache, v, meta.slot_mapping)
        else:
            super()._write(k_cache, v_cache, k, v, meta)

    def forward(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        """Decode rows run natively, a sliding layer's attending its last ``window`` keys, and
        so do prefill chunks where the build has the prefill kernel (AVX-512, head_dim a
        multiple of 16); with a softcap (Gemma 2) the reference runs them."""
        native = q.dtype == torch.float32 and k_cache.dtype in kv_quant.NATIVE_CODES
        prefill = native and meta.prefill_seq_ids and _native_prefill_available(q.shape[-1])
        return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale,
                                           decode=_native_decode if native else None,
                                           window=window, softcap=softcap,
                                           prefill=_native_prefill if prefill else None)


class TritonBackend(AttentionBackend):
    name = "triton"
    metadata_type = TritonAttentionMetadata

    def _write(self, k_cache, v_cache, k, v, meta) -> None:
        from memwall.attention import triton_backend
        if k_cache.dtype in FP8_KV_DTYPES:
            k, v = to_fp8(k, k_cache.dtype), to_fp8(v, v_cache.dtype)
        triton_backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        from memwall.attention import triton_backend
        if softcap is not None or paged_torch.window_cuts(meta, range(meta.num_seqs), window):
            # the triton kernels attend every key without a cap; this step needs the reference
            return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale, window=window,
                                               softcap=softcap)
        return triton_backend.paged_attention(q, k_cache, v_cache, meta, scale)


_INSTANCES: dict[str, AttentionBackend] = {}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}[name]()
    return _INSTANCES[name]


def choose(device: torch.device | str) -> str:
    """triton on a CUDA device where triton can compile; cpu where the native kernels build;
    else the torch reference."""
    if torch.device(device).type == "cuda":
        from memwall.attention import triton_backend
        return "triton" if triton_backend.available() else "torch"
    return "cpu" if _native_available() else "torch"


def _native_available() -> bool:
    from memwall.kernels.cpu.build import available
    return available()


def bind(model: torch.nn.Module, backend: AttentionBackend) -> None:
    """Every attention module of ``model`` runs ``backend`` from now on (no global switch)."""
    for module in model.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = backend


# Function forms for code and tests that hold metadata but no backend object.
def write_kv(k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
    get_backend(meta.backend).write_kv(k_cache, v_cache, k, v, meta)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    return get_backend(meta.backend).forward(q, k_cache, v_cache, meta, scale, window, softcap)


def _native_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out,
                   window: int | None = None) -> None:
    """The one-token rows of a CPU step through memwall/kernels/cpu/decode.c: each sequence's
    blocks are read where they lie, where the torch reference gathers a padded copy of them
    (``window``: a sliding layer's, each row attending its last ``window`` keys)."""
    from memwall.kernels.cpu.decode import paged_decode_attention
    batch = meta.decode
    out[batch.token_index] = paged_decode_attention(q[batch.token_index], k_cache, v_cache,
                                                    batch.block_tables, batch.seq_lens, scale,
                                                    window=window)


@functools.cache
def _native_prefill_available(head_dim: int) -> bool:
    from memwall.kernels.cpu.decode import prefill_attention_available
    return prefill_attention_available(head_dim)


def _native_prefill(q, k_cache, v_cache, block_table, seq_len: int, scale: float,
                    window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk through memwall/kernels/cpu/paged_attention.c: its blocks read where
    they lie (the reference gathers a float copy of the whole context for torch's SDPA);
    1.6x SDPA's speed at 512 tokens on a 2-core AMD EPYC (Zen 4)."""
    from memwall.kernels.cpu.decode import paged_prefill_attention
    return paged_prefill_attention(q, k_cache, v_cache, block_table, seq_len, scale, window=window,
                                   out=out)


def to_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Saturating conversion: out-of-range values become +-448 (never NaN), on every device
    (kv_quant.quantize, which every KV format goes through)."""
    return kv_quant.quantize(x, dtype)[0]
