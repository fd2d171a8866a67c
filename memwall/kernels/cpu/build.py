"""Builds the C kernels beside this file (kernels.h lists them) into one shared library with
the system C compiler on first use, caches it, and loads it with ctypes.

    lib()          the library for this CPU (-march=native), or None: MEMWALL_NATIVE=0, no C
                   compiler, not Linux, or the build failed (callers then use torch)
    available()    lib() is not None
    library(isa)   a build for one instruction set ("native", "avx2", "baseline": x86-64
                   without AVX), so tests can run every code path the C files hold

The cache (``$XDG_CACHE_HOME/memwall/native``) is keyed by the sources, compiler, flags and
CPU, so an edited kernel or another machine rebuilds. Threads: OpenMP, linked by soname
against the libgomp torch has already loaded, so the kernels share torch's thread pool and
``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("memwall")

HERE = Path(__file__).resolve().parent
SOURCES = ("quant_gemm.c", "int_gemm.c", "int8_dot.c", "int8_tiles.c", "panel_gemm.c",
           "packed_gemm.c",
           "paged_attention.c", "decode.c", "elementwise.c", "split_bf16.c", "shm_comm.c",
           "gguf_codes.c")
HEADERS = ("kernels.h",)
INT8_TILES_MODES = {"0": 0, "1": 1, "all": 2}  # MEMWALL_INT8_TILES -> mw_set_int8_tiles
# -ffp-contract=off: a weight s * q + c is rounded as the reference dequantizer rounds it.
# -Bsymbolic: calls between the files stay inside one build when tests load several.
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11",
         "-Wl,-Bsymbolic")
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx2": ("-march=x86-64", "-mavx2", "-mfma"),
    "baseline": ("-march=x86-64",),  # SSE2 only: the plain C paths
}


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded (the message says why)."""


# What the checked entry points return (the MW_* codes of kernels.h), as the error to raise.
_ERRORS = {
    -1: (MemoryError, "could not allocate its scratch buffers"),
    -2: (ValueError, "got a sequence length outside 1..table_width * block_size"),
    -3: (ValueError, "got a block table entry outside the KV cache's blocks"),
    -4: (ValueError, "got a position outside the model's rotary tables (max_position_embeddings)"),
    -5: (ValueError, "got a cache slot outside the KV cache"),
    -6: (ValueError, "got a LoRA slot outside -1..max_loras - 1 (or LoRA on a model built "
                     "without it)"),
    -7: (TimeoutError, "timed out waiting for another tensor-parallel rank (it died or hangs)"),
    -8: (RuntimeError, "was aborted: a tensor-parallel rank failed (or the group was aborted); "
                       "the group cannot be used again"),
    -9: (NotImplementedError, "has no kernel in this build for the shape (AVX-512, head_dim a "
                              "multiple of 16)"),
}


def raise_for(rc: int, where: str) -> None:
    """Turns a kernel's return code into an exception that says what was wrong (0: none)."""
    if rc != 0:
        kind, what = _ERRORS.get(rc, (RuntimeError, f"failed with code {rc}"))
        raise kind(f"{where} {what}")


def _cpu_key() -> str:
    """Distinguishes CPUs, because -march=native code may not run on another one."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), *lines])


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where unreadable)."""
    line = next((ln for ln in _cpu_key().splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def runs_here(isa: str) -> bool:
    """Whether a build for ``isa`` can run on this machine."""
    if isa == "native":
        return True
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    return isa == "baseline" or {"avx2", "fma"} <= cpu_flags()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(cc: str, isa: str) -> Path:
    """The cached library for ``isa``, compiled first when missing."""
    flags = (*FLAGS, *ISA_FLAGS[isa])
    texts = [(HERE / name).read_text() for name in (*HEADERS, *SOURCES)]
    key = hashlib.sha256("\0".join([*texts, cc, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "memwall" / "native"
    lib = cache / f"cpu-{isa}-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / "kernels.so"
        done = subprocess.run([cc, *flags, f"-I{HERE}", *(str(HERE / s) for s in SOURCES),
                               "-o", str(out)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise BuildError(f"{cc} failed to compile memwall/kernels/cpu ({isa}):\n"
                             f"{done.stderr.strip()[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent builder never sees half a file
    return lib


@functools.cache
def library(isa: str = "native") -> ctypes.CDLL:
    """The kernels built for ``isa`` (see ISA_FLAGS), loaded and declared; raises BuildError
    when there is no compiler or the build fails. Tests use this; the engine uses ``lib()``."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}; use one of {', '.join(ISA_FLAGS)}")
    cc = compiler()
    if cc is None or platform.system() != "Linux":
        raise BuildError("no C compiler (set CC or install gcc), or not Linux")
    if not runs_here(isa):
        raise BuildError(f"this CPU cannot run the {isa} build (flags: avx2/fma missing)")
    try:
        cdll = ctypes.CDLL(str(_compile(cc, isa)))
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"building memwall's CPU kernels failed: {e}") from e
    _declare(cdll)
    # MEMWALL_INT_ACTS=0 keeps one-token matmuls on the exact fp32 kernels
    cdll.mw_set_int_acts(int(os.environ.get("MEMWALL_INT_ACTS", "1") != "0"))
    # MEMWALL_INT8_TILES=0 keeps prefill on K-quants on int16 activations (int_gemm.c); =all
    # also sends Q4_0/Q4_1 prefill to int8 (off by default: see int8_tiles.c)
    cdll.mw_set_int8_tiles(INT8_TILES_MODES.get(os.environ.get("MEMWALL_INT8_TILES", "1"), 1))
    return cdll


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The engine's kernels (this CPU's build), or None where they cannot be had."""
    if os.environ.get("MEMWALL_NATIVE", "1") == "0":
        return None
    if compiler() is None or platform.system() != "Linux":
        logger.info("no C compiler: memwall's CPU kernels are off, torch's ops serve instead")
        return None
    try:
        return library("native")
    except BuildError as e:
        logger.warning("memwall's CPU kernels are not available (%s); using torch instead",
                       str(e).splitlines()[0])
        return None


def available() -> bool:
    """True when the kernels are built (or were cached) and loadable on this machine."""
    return lib() is not None


def require() -> ctypes.CDLL:
    """``lib()``, or a RuntimeError that says why there is none."""
    cdll = lib()
    if cdll is None:
        raise RuntimeError("memwall's CPU kernels are not available (MEMWALL_NATIVE=0, no C "
                           "compiler, or the build failed: see the log); check available() first")
    return cdll


def _declare(cdll: ctypes.CDLL) -> None:
    """ctypes signatures, as kernels.h declares them."""
    i64, i32, p, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    f64 = ctypes.c_double
    signatures = {
        "q4_gemm": (None, [p, i64, i64, p, p, p, p, i64, i32]),
        "q8_gemm": (None, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "q4_gemm_tiles": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "q8_gemm_tiles": (i32, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "q4_dequant": (None, [p, p, p, p, i64, i64, i32]),
        "q8_dequant": (None, [p, p, p, p, i64, i64, i64, i32]),
        "mw_q4_dequant_split": (None, [p, p, p, p, p, i64, i64, i32]),
        "mw_q8_dequant_split": (None, [p, p, p, p, p, i64, i64, i64, i32]),
        "mw_tiles_from": (i64, []),
        "mw_split_bf16": (None, [p, i64, p, p]),
        "mw_q4_gemv_i8": (i32, [p, i64, p, p, p, p, i64, i32]),
        "mw_q8_gemv_i8": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "mw_q4_gemm_i8": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "mw_q8_gemm_i8": (i32, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "mw_set_int_acts": (None, [i32]),
        "mw_int_gemm_isa": (i32, []),
        "mw_int_acts_on": (i32, []),
        "mw_q4_gemm_i16": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "mw_q8_gemm_i16": (i32, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "mw_int8_dot_available": (i32, []),
        "mw_set_int8_tiles": (None, [i32]),
        "mw_int8_tiles_on": (i32, []),
        "mw_int8_tiles_fit": (i32, [i32, i64, i64, i32]),
        "mw_q4_gemm_i8t": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "mw_q8_gemm_i8t": (i32, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "mw_panel_available": (i32, []),
        "mw_packed_available": (i32, []),
        "mw_packed_gemm": (i32, [p, i64, i64, p, p, p, i32, p, i64, i64]),
        "mw_packed_gemm_p16": (i32, [p, i64, i64, p, p, p, i32, p, i64, i64]),
        "mw_packed_rows": (None, [p, p, p, i64, i32, p, i64, p]),
        "mw_q4_gemm_p16": (i32, [p, i64, i64, p, p, p, p, i64, i32]),
        "mw_q8_gemm_p16": (i32, [p, i64, i64, i64, p, p, p, p, i64, i32]),
        "mw_paged_decode_attention": (i32, [p, p, p, p, i64, p, i64, i64, i64, i64, i64, i64,
                                            f32, p]),
        "mw_paged_decode_attention_kv": (i32, [p, p, p, p, p, i32, p, i64, p, i64, i64, i64,
                                               i64, i64, i64, f32, i64, p]),
        "mw_kv_write": (i32, [p, i64, p, i64, i64, i64, i32, p, p]),
        "mw_prefill_attention_available": (i32, [i64]),
        "mw_rms_norm": (None, [p, p, p, p, p, i64, i64, f32]),
        "mw_gated_act": (None, [p, i64, i64, i32, p]),
        "mw_rope": (i32, [p, i64, p, i64, i64, i64, p, p, i64]),
        "mw_paged_prefill_attention": (i32, [p, p, p, p, p, i32, p, i64, i64, i64, i64, i64, i64,
                                             i64, i64, f32, i64, p]),
        "mw_decode_step": (i32, [p, p, i64, p, p, p, p, i64, p, p, p]),
        "mw_profile": (None, [i32, p]),
        "mw_gguf_q4_k_codes": (None, [p, i64, i64, p]),
        "mw_gguf_q6_k_codes": (None, [p, i64, i64, p]),
        "mw_gguf_q5_codes": (None, [p, i64, i64, i64, i64, i32, p]),
        "mw_gguf_k_scales": (None, [p, i64, i64, p, p]),
        "mw_shm_bytes": (i64, [i64, i64]),
        "mw_shm_init": (None, [p, i64, i64]),
        "mw_shm_attach": (i32, [p, p, i64, i64, f64]),
        "mw_shm_allreduce": (i32, [p, p, i64]),
        "mw_shm_allgather": (i32, [p, p, i64, p, p]),
        "mw_shm_barrier": (i32, [p]),
        "mw_shm_abort": (None, [p]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
