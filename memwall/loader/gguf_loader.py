"""Native GGUF loading: open the file, map its metadata to an HF-style config, and yield
its tensors under Hugging Face transformers names, dequantized.

GGUF (llama.cpp)                     HF transformers
token_embd.weight                    model.embed_tokens.weight
blk.{i}.attn_norm.weight             model.layers.{i}.input_layernorm.weight
blk.{i}.attn_{q,k,v}.{weight,bias}   model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}
blk.{i}.attn_output.weight           model.layers.{i}.self_attn.o_proj.weight
blk.{i}.attn_{q,k}_norm.weight       model.layers.{i}.self_attn.{q,k}_norm.weight   (qwen3)
blk.{i}.ffn_norm.weight              model.layers.{i}.post_attention_layernorm.weight
blk.{i}.ffn_{gate,up,down}.weight    model.layers.{i}.mlp.{gate,up,down}_proj.weight
Gemma: blk.{i}.post_attention_norm, ffn_norm, post_ffw_norm -> post_attention_layernorm,
       pre_feedforward_layernorm, post_feedforward_layernorm (norm weights hold 1 + w already)
output_norm.weight                   model.norm.weight
output.weight                        lm_head.weight            (absent when tied)

GGUF lists dimensions fastest-first (``ne``); numpy/torch order is the reverse, so a
GGUF ``[in, out]`` matrix is an HF ``[out, in]`` weight with no transpose needed.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Container, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, GGUFValueType

from memwall.loader.errors import ModelLoadError
from memwall.loader.gguf_file import GGUFFile
from memwall.loader.gguf_weights import SUPPORTED_GGUF_TYPES, dequantize, is_supported

__all__ = ["ModelLoadError", "SUPPORTED_GGUF_ARCHS", "SUPPORTED_GGUF_TYPES", "open_gguf",
           "gguf_hf_config", "iter_gguf_tensors"]

SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")

_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                # Gemma's sandwich norms (its ffn_norm is the pre-feedforward one: _GEMMA_NAMES)
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not weights of the HF model: llama3 rope factors (read into rope_scaling instead) and the
# rotary inv_freq buffers some old converters kept.
_IGNORED_RE = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")


# --------------------------------------------------------------------------- opening

def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file: metadata parsed, tensors read from the file when their ``data`` is
    asked for (memwall/loader/gguf_file.py; shaped like ``gguf.GGUFReader``).

    A missing path, a directory, a file that is not GGUF, and a truncated or corrupt file
    all raise ModelLoadError with a one-line message naming the path and the problem.
    """
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"GGUF file {str(p)!r} does not exist")
    if not p.is_file():
        raise ModelLoadError(f"{str(p)!r} is not a file (expected a .gguf file)")
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        what = "the file is empty" if size == 0 else f"it starts with {magic!r}, not b'GGUF'"
        raise ModelLoadError(f"{str(p)!r} is not a GGUF file ({what})")
    try:
        reader = GGUFFile(p)
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
        if "big-endian" in str(e):
            raise ModelLoadError(f"{str(p)!r} is a big-endian GGUF file, which is not supported")
        raise ModelLoadError(f"{str(p)!r} is a truncated or corrupt GGUF file ({size} bytes; "
                             f"{_one_line(e)})") from e
    for t in reader.tensors:  # the reader checks shapes, but not every path: be sure
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{str(p)!r} is truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


# --------------------------------------------------------------------------- metadata

def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value as a Python object; ``default`` when absent.

    Arrays are not decoded here (a 150k-entry token list is slow); see _array_len.
    """
    f = reader.fields.get(key)
    if f is None or not f.types or not f.data:
        return default
    kind = f.types[0]
    if kind == GGUFValueType.ARRAY:
        return default
    part = f.parts[f.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0].item()
    if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        # GGUF stores f32: 1e-5 comes back as 9.999999747e-06. The shortest f32 repr
        # recovers the decimal the model's config.json had.
        return float(str(np.float32(value))) if kind == GGUFValueType.FLOAT32 else float(value)
    return value


def _array_len(reader: GGUFFile, key: str) -> int | None:
    f = reader.fields.get(key)
    return len(f.data) if f is not None and f.types and f.types[0] == GGUFValueType.ARRAY else None


def _tensor_map(reader: GGUFFile) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _np_shape(t: Any) -> tuple[int, ...]:
    """GGUF lists ne fastest-first; numpy order is the reverse."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def gguf_hf_config(reader: GGUFFile) -> dict[str, Any]:
    """An HF-transformers-style config dict from the GGUF metadata.

    Shapes come from ``{arch}.*`` keys. Derived values: vocab_size falls back to the token
    list length; head_dim is attention.key_length, else q rows / heads, else hidden / heads;
    tie_word_embeddings is True when there is no output.weight; attention_bias is True for
    qwen2 or when q biases exist; rope_scaling comes from rope.scaling.* metadata or, for
    Llama 3.x, from the rope_freqs.weight tensor (None when unscaled). A "llama" file whose
    general.name mentions Mistral gets model_type "mistral", as in transformers.

    Raises ModelLoadError for an architecture outside SUPPORTED_GGUF_ARCHS or when a
    required shape key is missing.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")
    # llama.cpp writes Mistral models as arch "llama"; transformers tells them apart by the
    # name, and so do we (the only difference is the config class).
    name = str(_field(reader, "general.name", "")).lower()
    model_type = "mistral" if arch == "llama" and "mistral" in name else arch
    tensors = _tensor_map(reader)

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = _head_dim(reader, arch, tensors, hidden, heads)
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    has_bias = "blk.0.attn_q.bias" in tensors
    if arch == "gemma3":
        model_type = "gemma3_text"
    config = {
        "model_type": model_type,
        "architectures": [_HF_ARCHITECTURES[model_type]],
        "vocab_size": _vocab_size(reader, arch, tensors),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": model_type == "qwen2" or has_bias,
        "rope_scaling": _rope_scaling(reader, arch, tensors, head_dim, rope_theta),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(reader, arch, config))
    return config


def _gemma_config(reader: GGUFFile, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp knows of Gemma without metadata (llama-model.cpp): the sliding-layer
    pattern (every 2nd layer full in Gemma 2, every 6th in Gemma 3), the local rope base
    (10,000), and the attention scale: 1/sqrt(head_dim), except the 27B models' 1/sqrt(hidden /
    heads)."""
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))  # the 27B models
    out = {"hidden_activation": "gelu_pytorch_tanh",
           "sliding_window": _field(reader, f"{arch}.attention.sliding_window"),
           "sliding_window_pattern": 2 if arch == "gemma2" else 6,
           "query_pre_attn_scalar": hidden // heads if big else config["head_dim"],
           "memwall_norms_hold_offset": True}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _field(reader, "gemma2.attn_logit_softcapping")
        out["final_logit_softcapping"] = _field(reader, "gemma2.final_logit_softcapping")
    else:
        out["rope_local_base_freq"] = 10_000.0
    return out


def _head_dim(reader: GGUFFile, arch: str, tensors: dict, hidden: int, heads: int) -> int:
    """attention.key_length when written, else the q projection's rows / heads, else hidden / heads."""
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length:
        return int(key_length)
    if "blk.0.attn_q.weight" in tensors:
        return _np_shape(tensors["blk.0.attn_q.weight"])[0] // heads
    return hidden // heads


def _vocab_size(reader: GGUFFile, arch: str, tensors: dict) -> int:
    size = _field(reader, f"{arch}.vocab_size") or _array_len(reader, "tokenizer.ggml.tokens")
    if not size and "token_embd.weight" in tensors:
        size = _np_shape(tensors["token_embd.weight"])[0]
    if not size:
        raise ModelLoadError("GGUF file has no vocab_size, token list or token_embd.weight")
    return int(size)


# --------------------------------------------------------------------------- rope scaling

def _rope_scaling(reader: GGUFFile, arch: str, tensors: dict, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    """HF rope_scaling from ``{arch}.rope.scaling.*`` metadata, or inferred from the
    ``rope_freqs.weight`` tensor that llama.cpp writes for Llama 3.1+ instead of metadata."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "llama3":
        return {"rope_type": "llama3", "factor": float(factor or 8.0),
                "low_freq_factor": float(_field(reader, f"{arch}.rope.scaling.low_freq_factor", 1.0)),
                "high_freq_factor": float(_field(reader, f"{arch}.rope.scaling.high_freq_factor", 4.0)),
                "original_max_position_embeddings": int(orig or 8192)}
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": float(factor or 1.0)}
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
        factors = dequantize(t.data, t.tensor_type, _np_shape(t)).double().numpy().reshape(-1)
        return llama3_scaling_from_factors(factors, theta, rope_dim)
    return None


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float,
                    old_len: float) -> np.ndarray:
    """llama.cpp's per-frequency divisors for llama3 rope (convert_hf_to_gguf.py)."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict | None:
    """Recover HF llama3 rope parameters from llama.cpp's ``rope_freqs`` divisors.

    Only ratios are observable (old_len/low, old_len/high), so low_freq_factor is fixed to
    1.0 (its value in every Llama 3.x release) and the rest is solved for: for the
    "medium" frequencies, smooth = old_len/(high-low) / wavelen - low/(high-low), a line
    in 1/wavelen. With fewer than two medium frequencies the line is not determined and
    any parameters that reproduce the factors are chosen. The result is checked by
    recomputing the factors; a mismatch raises ModelLoadError rather than guessing.
    """
    factors = np.asarray(factors, dtype=np.float64)
    big = float(factors.max())
    if big <= 1.0 + 1e-6:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if len(wavelen) != len(factors):
        raise ModelLoadError(f"rope_freqs.weight has {len(factors)} entries, expected {len(wavelen)}")
    high = np.isclose(factors, 1.0, rtol=1e-5)
    low = np.isclose(factors, big, rtol=1e-5)
    mid = ~high & ~low
    smooth = (1 / factors - 1 / big) / (1 - 1 / big)
    factor = round(big, 4)
    candidates: list[tuple[float, float]] = []  # (old_len, high_freq_factor), low_freq_factor = 1
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[mid], smooth[mid], 1)
        b = -intercept  # = low / (high - low)
        if b > 0:
            candidates += [(round(slope / b), 1 + 1 / b), (slope / b, 1 + 1 / b)]
    else:
        lo = wavelen[high].max() if high.any() else wavelen[0] / 2
        hi = wavelen[low].min() if low.any() else wavelen[-1] * 2
        if mid.any():
            lo = wavelen[mid][0]
        for old_len in [2.0 ** k for k in range(0, 40) if lo < 2.0 ** k < hi] + [math.sqrt(lo * hi)]:
            if mid.any():
                hf = 1 + (old_len / wavelen[mid][0] - 1) / smooth[mid][0]
            else:
                hf = old_len / math.sqrt(lo * old_len)
            candidates.append((old_len, hf))
    # prefer round numbers (what the model's config.json said) when they fit as well
    candidates = [(old_len, round(hf, 4)) for old_len, hf in candidates] + candidates
    for old_len, hf in candidates:
        if hf > 1 and np.allclose(_llama3_factors(theta, dim, factor, 1.0, hf, old_len), factors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": float(hf), "original_max_position_embeddings":
                    int(old_len) if float(old_len).is_integer() else float(old_len)}
    raise ModelLoadError("rope_freqs.weight does not match llama3-style rope scaling; "
                         "this rope scaling is not supported")


# --------------------------------------------------------------------------- tensors

def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF name of a GGUF tensor (``arch``: the file's general.architecture, where names
    differ by family); None for tensors that are not model weights; ModelLoadError for names
    this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if _IGNORED_RE.fullmatch(gguf_name):
        return None
    names = _GEMMA_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the "
                             f"supported architectures ({', '.join(SUPPORTED_GGUF_ARCHS)})")
    layer, part, kind = m.groups()
    return f"model.layers.{int(layer)}.{names[part]}.{kind}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's q/k row permutation (llama/mistral only).

    llama.cpp rotates interleaved pairs (x0,x1),(x2,x3)...; HF rotates halves (x_i, x_{i+d/2}).
    The converter reorders each head's rows from [half0 | half1] to [h0[0],h1[0],h0[1],...];
    this puts them back. Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _check_tensors(reader: GGUFFile, config: dict[str, Any]) -> None:
    """Fail before loading anything: every tensor must have a known name, a layer index
    inside the model, and a supported type."""
    layers = config["num_hidden_layers"]
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            raise ModelLoadError(f"GGUF tensor {t.name!r} is outside the model's {layers} layers")
        if not is_supported(t.tensor_type):
            raise ModelLoadError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which is "
                                 f"not supported (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")


def read_tensor_rows(t: Any, rows: np.ndarray, byte_range: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 ``[len(rows), width]``: rows ``rows`` of a 2-D GGUF tensor (bytes ``byte_range``
    of each), read from the file without the rest (``gguf_file.Tensor.read_rows``), or cut
    from a ``gguf.GGUFReader`` tensor's mapped bytes."""
    if hasattr(t, "read_rows"):
        return t.read_rows(rows, byte_range)
    raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)
    start, stop = byte_range if byte_range is not None else (0, raw.shape[1])
    return np.ascontiguousarray(raw[np.asarray(rows), start:stop])


def _read_slice(t: Any, part: Any, n_head: int | None) -> torch.Tensor:
    """A tensor-parallel rank's ``TensorSlice`` of one GGUF tensor, in HF layout (float32):
    only its rows are read, and of those only its columns' bytes, unless the cut falls inside
    a quantized block (then whole rows, cut after decoding: blocks decode independently)."""
    shape = _np_shape(t)
    if len(shape) != 2:  # biases and norms: tiny, read whole
        w = dequantize(t.data, t.tensor_type, shape)
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        return part.apply(w)
    rows = part.row_index(shape[0])
    if n_head is not None:  # HF row -> the file's (permuted) row
        rows = unpermute_qk(torch.arange(shape[0]), n_head).numpy()[rows]
    qtype = QType(t.tensor_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = part.cols or (0, shape[1])
    if cols[0] % block == 0 and cols[1] % block == 0:  # whole blocks (or a float type)
        byte_range = (cols[0] // block * type_size, cols[1] // block * type_size)
        return dequantize(read_tensor_rows(t, rows, byte_range), qtype, (len(rows), cols[1] - cols[0]))
    w = dequantize(read_tensor_rows(t, rows), qtype, (len(rows), shape[1]))
    return w[:, cols[0]:cols[1]].contiguous()


def iter_gguf_tensors(reader: GGUFFile, config: dict[str, Any],
                      dtype: torch.dtype = torch.float32,
                      skip: Container[str] = (),
                      slice_of: Callable[[str], Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every model weight, in file order, as ``dtype``.

    Names in ``skip`` are neither decoded nor yielded (weights the caller keeps quantized).
    ``slice_of(hf_name)``: the part of each tensor a tensor-parallel rank holds
    (memwall/loader/slicing.py); only that part is read from the file.

    ``config`` is :func:`gguf_hf_config`'s result (heads drive the q/k un-permutation).
    All names and types are validated before the first tensor is decoded, so a bad file
    fails fast with ModelLoadError instead of half-way through loading.
    """
    _check_tensors(reader, config)
    # Only llama-arch files were permuted by the converter; qwen2/qwen3 are stored as-is.
    arch = _field(reader, "general.architecture")
    permuted = arch in ("llama", "mistral")
    heads = {".self_attn.q_proj.": config["num_attention_heads"],
             ".self_attn.k_proj.": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None or name in skip:
            continue
        n_head = next((n for key, n in heads.items() if key in name), None) if permuted else None
        part = slice_of(name) if slice_of is not None else None
        if part is not None:
            yield name, _read_slice(t, part, n_head).to(dtype).contiguous()
            continue
        w = dequantize(t.data, t.tensor_type, _np_shape(t))
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        yield name, w.to(dtype).contiguous()
