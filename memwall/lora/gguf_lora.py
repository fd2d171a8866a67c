"""load_gguf_lora: a GGUF LoRA adapter as llama.cpp's convert_lora_to_gguf.py writes it -> LoRAAdapter.

    general.type          "adapter"
    general.architecture  the base model's GGUF arch ("llama", "qwen2", ...)
    adapter.type          "lora"
    adapter.lora.alpha    f32; absent or 0: no scaling at all (llama.cpp's rule, below)
    blk.N.<part>.weight.lora_a   ne [in, r]   = numpy [r, in]    (PEFT's lora_A as is)
    blk.N.<part>.weight.lora_b   ne [r, out]  = numpy [out, r]   (PEFT's lora_B as is)
        part: attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down
        types: F32, F16, BF16, Q8_0 (the converter's --outtype; a Q8_0 file keeps F16 for a
        tensor whose last axis is not a multiple of 32, e.g. every lora_b of rank < 32)

The converter runs the base model class's modify_tensors on a lazy (A, B) pair, so for llama
and mistral (convert_hf_to_gguf.py LlamaModel.permute) the rows of B for q and k are permuted
exactly as the base model's q/k weights are, and A is left alone: loading un-permutes B with the
base loader's unpermute_qk (n_head for q, n_head_kv for k). Those head counts are not in the
adapter file; they come from ``base_config`` (HF-style: num_attention_heads,
num_key_value_heads), else from ``{arch}.attention.head_count[_kv]`` if some tool wrote them.

Scaling, from llama.cpp (src/llama-adapter.h, llama_adapter_lora_weight::get_scale):
``scale = alpha ? alpha / r : 1`` with r the module's own rank (lora_b's ne[0]); a missing
alpha key reads as 0, so it is the same as alpha = r. rsLoRA is not expressible in this format.
B comes back with the scale folded in, as LoRAAdapter wants.

Refused with LoRAError (the server's 400 reason), never skipped: a model GGUF or another adapter
kind, aLoRA (adapter.alora.invocation_tokens: it must only apply after its invocation tokens),
tensors for anything but the seven projections (mergekit's norm replacements and embedding or
lm_head LoRA, which llama.cpp partly ignores: the adapter's outputs would be wrong), a lora_a
without its lora_b or the reverse, ranks that disagree, and tensor types memwall cannot decode.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFValueType, Keys

from memwall.loader.errors import ModelLoadError
from memwall.loader.gguf_file import GGUFFile
from memwall.loader.gguf_loader import SUPPORTED_GGUF_ARCHS, hf_tensor_name, open_gguf, unpermute_qk
from memwall.loader.gguf_weights import SUPPORTED_GGUF_TYPES, dequantize, is_supported
from memwall.lora.adapter import TARGETS, LoRAAdapter, LoRAError, LoRAWeights

PERMUTED_ARCHS = ("llama", "mistral")
"""Archs whose q/k rows the converter permutes (as memwall's base GGUF loader un-permutes)."""

_TENSOR = re.compile(r"^(.+)\.lora_([ab])$")
_HF_TARGET = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.weight$")
_PARTS = "attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down"
# A base config's HF model_type -> the GGUF arch an adapter for it carries (llama.cpp writes
# Mistral models as "llama").
_ARCH_OF_MODEL_TYPE = {"llama": ("llama", "mistral"), "mistral": ("llama", "mistral"),
                       "qwen2": ("qwen2",), "qwen3": ("qwen3",), "gemma2": ("gemma2",),
                       "gemma3": ("gemma3",), "gemma3_text": ("gemma3",)}


def load_gguf_lora(path: str, name: str, base_config: dict | None = None) -> LoRAAdapter:
    """Read the GGUF LoRA file at ``path``; ``base_config`` (HF-style) gives the head counts a
    llama/mistral adapter with q or k tensors needs, and its arch is checked against the file's."""
    try:
        reader = open_gguf(path)
    except ModelLoadError as e:
        raise LoRAError(f"adapter {name!r}: {e}") from None
    arch, alpha = _check_metadata(reader, name, base_config)
    pairs = _pairs(reader, name, arch)
    heads = _head_counts(reader, name, arch, base_config, pairs) if arch in PERMUTED_ARCHS else {}
    modules = {module: _weights(name, a, b, alpha, heads.get(_target(module)))
               for module, (a, b) in sorted(pairs.items())}
    rank = max(w.a.shape[0] for w in modules.values())
    return LoRAAdapter(name, str(path), _sha256(path), rank, modules)


# --------------------------------------------------------------------------- metadata

def _meta(reader: GGUFFile, key: str) -> tuple[GGUFValueType | None, Any]:
    """(type, value) of a scalar or string key; (None, None) when absent, (ARRAY, None) for arrays."""
    f = reader.fields.get(key)
    if f is None or not f.types:
        return None, None
    kind = f.types[0]
    if kind == GGUFValueType.ARRAY or not f.data:
        return kind, None
    part = f.parts[f.data[0]]
    if kind == GGUFValueType.STRING:
        return kind, bytes(part).decode("utf-8", errors="replace")
    return kind, part[0].item()


def _check_metadata(reader: GGUFFile, name: str, base_config: dict | None) -> tuple[str, float]:
    """The file's arch and lora alpha (0.0 when absent), after checking it is a LoRA adapter."""
    _, general_type = _meta(reader, Keys.General.TYPE)
    if general_type != "adapter":
        what = "has no general.type" if general_type is None else f"has general.type {general_type!r}"
        raise LoRAError(f"adapter {name!r}: the GGUF file {what}, not 'adapter': it is not a LoRA "
                        f"adapter (a model GGUF?); convert the PEFT adapter with llama.cpp's "
                        f"convert_lora_to_gguf.py")
    _, adapter_type = _meta(reader, Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise LoRAError(f"adapter {name!r}: adapter.type is {adapter_type!r}, not 'lora'")
    if Keys.Adapter.ALORA_INVOCATION_TOKENS in reader.fields:
        raise LoRAError(f"adapter {name!r}: activated LoRA (aLoRA, "
                        f"{Keys.Adapter.ALORA_INVOCATION_TOKENS}) is not supported")
    _, arch = _meta(reader, Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise LoRAError(f"adapter {name!r}: general.architecture is {arch!r}; supported: "
                        f"{', '.join(SUPPORTED_GGUF_ARCHS)}")
    model_type = (base_config or {}).get("model_type")
    if model_type in _ARCH_OF_MODEL_TYPE and arch not in _ARCH_OF_MODEL_TYPE[model_type]:
        raise LoRAError(f"adapter {name!r} is for a {arch!r} model, but the served model is "
                        f"{model_type!r}")
    return arch, _alpha(reader, name)


def _alpha(reader: GGUFFile, name: str) -> float:
    kind, value = _meta(reader, Keys.Adapter.LORA_ALPHA)
    if kind is None:
        return 0.0  # llama.cpp reads a missing key as 0: no scaling
    if kind in (GGUFValueType.STRING, GGUFValueType.BOOL, GGUFValueType.ARRAY):
        raise LoRAError(f"adapter {name!r}: {Keys.Adapter.LORA_ALPHA} is a {kind.name.lower()}, "
                        f"not a number")
    if not math.isfinite(value):
        raise LoRAError(f"adapter {name!r}: {Keys.Adapter.LORA_ALPHA} is {value}")
    return float(value)


# --------------------------------------------------------------------------- tensors

def _pairs(reader: GGUFFile, name: str, arch: str) -> dict[str, tuple[Any, Any]]:
    """HF module name -> (lora_a tensor, lora_b tensor), every name and type checked."""
    halves: dict[str, dict[str, Any]] = {}
    gguf_names: dict[str, str] = {}
    for t in reader.tensors:
        module, half = _module_of(t.name, name, arch)
        if not is_supported(t.tensor_type):
            raise LoRAError(f"adapter {name!r}: tensor {t.name!r} has type {t.tensor_type.name}, "
                            f"which memwall cannot read (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")
        if len(t.shape) != 2:
            raise LoRAError(f"adapter {name!r}: tensor {t.name!r} has {len(t.shape)} dimensions "
                            f"{_shape(t)}, not 2")
        halves.setdefault(module, {})[half] = t
        gguf_names[module] = t.name.rsplit(".", 1)[0]
    if not halves:
        raise LoRAError(f"adapter {name!r}: the GGUF file holds no LoRA tensors")
    pairs = {}
    for module, pair in halves.items():
        if set(pair) != {"a", "b"}:
            have, missing = ("lora_a", "lora_b") if "a" in pair else ("lora_b", "lora_a")
            raise LoRAError(f"adapter {name!r}: {gguf_names[module]}.{have} has no "
                            f"{gguf_names[module]}.{missing}")
        a, b = pair["a"], pair["b"]
        if _shape(a)[0] != _shape(b)[1] or _shape(a)[0] < 1:
            raise LoRAError(f"adapter {name!r}: {a.name} is {_shape(a)} and {b.name} is {_shape(b)} "
                            f"(numpy order); they must be [r, in] and [out, r] with the same r")
        pairs[module] = (a, b)
    return pairs


def _module_of(tensor: str, name: str, arch: str) -> tuple[str, str]:
    """``blk.3.attn_q.weight.lora_a`` -> ("model.layers.3.self_attn.q_proj", "a")."""
    match = _TENSOR.match(tensor)
    if match is None:
        raise LoRAError(f"adapter {name!r}: tensor {tensor!r} is not a LoRA tensor (memwall reads "
                        f"blk.N.<part>.weight.lora_a/lora_b; norm weights are not supported)")
    try:
        hf = hf_tensor_name(match.group(1), arch)
    except ModelLoadError:
        hf = None
    target = _HF_TARGET.match(hf or "")
    if target is None or target.group(1) not in TARGETS:
        raise LoRAError(f"adapter {name!r}: tensor {tensor!r} targets {match.group(1)!r}; memwall "
                        f"serves LoRA on blk.N.<part>.weight with part one of {_PARTS}")
    return hf.removesuffix(".weight"), match.group(2)


def _shape(t: Any) -> list[int]:
    """numpy order: the reverse of GGUF's ne."""
    return [int(d) for d in reversed(t.shape.tolist())]


def _decode(t: Any, name: str) -> torch.Tensor:
    try:
        return dequantize(t.data, t.tensor_type, tuple(_shape(t)))
    except ModelLoadError as e:
        raise LoRAError(f"adapter {name!r}: tensor {t.name!r}: {e}") from None


def _target(module: str) -> str:
    return module.rsplit(".", 1)[1]


def _weights(name: str, a_t: Any, b_t: Any, alpha: float, n_head: int | None) -> LoRAWeights:
    a, b = _decode(a_t, name), _decode(b_t, name)  # [r, in], [out, r] float32
    if n_head is not None:  # q/k of a llama-arch file: B's rows were permuted like the base weight
        b = unpermute_qk(b, n_head)
    r = a.shape[0]
    scale = alpha / r if alpha else 1.0
    return LoRAWeights(a.contiguous(), (b * scale).contiguous())


# --------------------------------------------------------------------------- q/k heads

def _head_counts(reader: GGUFFile, name: str, arch: str, base_config: dict | None,
                 pairs: dict[str, tuple[Any, Any]]) -> dict[str, int]:
    """{"q_proj": n_head, "k_proj": n_head_kv} for un-permuting B; {} when no q/k is targeted."""
    rows = {_target(m): _shape(b)[0] for m, (_, b) in pairs.items() if _target(m) in ("q_proj", "k_proj")}
    if not rows:
        return {}
    config = base_config if (base_config or {}).get("num_attention_heads") else None
    if config is not None:
        n_head = config["num_attention_heads"]
        n_kv = config.get("num_key_value_heads") or n_head  # HF's default: no GQA
    else:
        n_head = _meta(reader, f"{arch}.attention.head_count")[1]
        n_kv = _meta(reader, f"{arch}.attention.head_count_kv")[1] or n_head
    if not n_head:
        raise LoRAError(f"adapter {name!r}: a {arch} adapter's q/k lora_b must be un-permuted with "
                        f"the base model's head counts, and no base config with "
                        f"num_attention_heads was given")
    heads = {"q_proj": int(n_head), "k_proj": int(n_kv)}
    for target, n in rows.items():
        if n % (2 * heads[target]):
            raise LoRAError(f"adapter {name!r}: {target} lora_b has {n} rows, which {heads[target]} "
                            f"heads cannot split (wrong base model?)")
    return heads


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(Path(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
