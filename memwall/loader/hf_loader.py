"""Hugging Face checkpoint directories: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Container, Iterator

import torch
from safetensors import safe_open

from memwall.loader.errors import ModelLoadError
from memwall.models.registry import SUPPORTED_ARCHITECTURES

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {archs[0] if archs else cfg.get('model_type')!r} in "
                             f"{path} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights (PyTorch .bin files are "
                             "not loaded: convert them with safetensors first)")
    return found


def iter_hf_tensors(model_dir: Path, dtype: torch.dtype, skip: Container[str] = (),
                    slice_of: Callable[[str], Any] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in ``dtype``) for every tensor of the checkpoint not named in ``skip``
    (those a quantized checkpoint's loader reads itself: memwall/loader/hf_quantized.py).
    ``slice_of(name)``: the part a tensor-parallel rank holds (memwall/loader/slicing.py),
    read alone through safetensors' ``get_slice``."""
    for path in safetensors_files(model_dir):
        if not path.is_file():
            raise ModelLoadError(f"shard {path.name} listed in {INDEX_FILE} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in skip:
                        continue
                    part = slice_of(name) if slice_of is not None else None
                    if part is None:
                        yield name, f.get_tensor(name).to(dtype)
                    else:
                        yield name, part.read_safetensors(f.get_slice(name)).to(dtype)
        except (OSError, RuntimeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {path}: {e}") from None
