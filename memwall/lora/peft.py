"""load_peft_adapter: a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``)
-> LoRAAdapter.

PEFT names tensors ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``.lora_B.weight``
([out, r]); the scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), per module
when ``rank_pattern`` / ``alpha_pattern`` say so. What memwall does not serve (DoRA, trained
biases, modules_to_save, embedding or lm_head targets) is refused with the reason, never
silently dropped: the adapter's outputs would be wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from memwall.lora.adapter import LoRAAdapter, LoRAError, LoRAWeights

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(.*)\.lora_([AB])(?:\.default)?\.weight$")


def load_peft_adapter(path: str | Path, name: str) -> LoRAAdapter:
    folder = Path(path)
    config_file, weights_file = folder / CONFIG, folder / WEIGHTS
    if not config_file.is_file():
        raise LoRAError(f"adapter {name!r}: no {CONFIG} in {str(folder)!r}")
    if not weights_file.is_file():
        other = " (adapter_model.bin is not read: save with safetensors)" if (
            folder / "adapter_model.bin").exists() else ""
        raise LoRAError(f"adapter {name!r}: no {WEIGHTS} in {str(folder)!r}{other}")
    config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise LoRAError(f"adapter {name!r}: {CONFIG} is not JSON ({e})") from None
    _check_config(config, name)
    try:
        tensors = load_safetensors(weights_bytes)  # the bytes hashed are the bytes served
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} cannot be read ({e})") from None
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()
    modules = _modules(tensors, config, name)
    rank = max((w.a.shape[0] for w in modules.values()), default=0)
    return LoRAAdapter(name, str(folder), digest, rank, modules)


def _check_config(config: dict, name: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    refused = [("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full layers)")]
    for key, what in refused:
        if config.get(key):
            raise LoRAError(f"adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"adapter {name!r}: fan_in_fan_out (Conv1D layers) is not supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAError(f"adapter {name!r}: {CONFIG} has no positive integer 'r'")


def _pattern_value(module: str, patterns: dict, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _modules(tensors: dict[str, torch.Tensor], config: dict, name: str) -> dict[str, LoRAWeights]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight "
                            f"(DoRA magnitudes, embeddings and biases are not supported)")
        module = match.group(1).removeprefix(_PREFIX)
        pairs.setdefault(module, {})[match.group(2)] = tensor
    modules = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"adapter {name!r}: {module} has no {missing} tensor")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoRAError(f"adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B "
                            f"{list(b.shape)}; they must be [r, in] and [out, r]")
        r = a.shape[0]
        expected = _pattern_value(module, config.get("rank_pattern"), config["r"])
        if r != expected:
            raise LoRAError(f"adapter {name!r}: {module} has rank {r}, its config says {expected}")
        alpha = _pattern_value(module, config.get("alpha_pattern"), config.get("lora_alpha", r))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[module] = LoRAWeights(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS} holds no LoRA tensors")
    return modules


def load_adapter(path: str | Path, name: str, base_config: dict | None = None) -> LoRAAdapter:
    """A PEFT directory, or a GGUF LoRA file as llama.cpp writes it (memwall/lora/gguf_lora.py)."""
    p = Path(path)
    if not p.exists():
        raise LoRAError(f"adapter {name!r}: {str(p)!r} does not exist")
    if p.is_file():
        from memwall.lora.gguf_lora import load_gguf_lora
        return load_gguf_lora(str(p), name, base_config)
    return load_peft_adapter(p, name)
