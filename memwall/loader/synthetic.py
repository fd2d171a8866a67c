"""A Llama-shaped GGUF with random Q4_1 weights and the embedded SmolLM2 tokenizer: a model of
any size that memwall (and llama.cpp) load and run, without downloading one. Its text is noise;
its sizes and speeds are those of a real model of that shape.

    write(out, hidden, layers, heads, kv_heads, ffn, vocab=None)

Users: benchmarks/synthetic_gguf.py (presets such as Llama-3.2-1B's shape, for memory and speed
measurements) and memwall/planner/calibrate/engine.py (tiny models whose steps are all
overhead).

The weights are random but well-formed (finite fp16 scales, weights within +-0.15), laid out
as the embedded SmolLM2 Q4_1 file is: Q4_1 matrices, a Q8_0 token embedding tied to the
output, F32 norms. The tokenizer and chat template are copied from the embedded file; a
vocabulary larger than its 49,152 tokens (Llama 3.2's 128,256) pads the token list with unused
tokens ``<|unused_N|>`` (type UNUSED: never produced by the tokenizer, ordinary vocabulary
entries for both engines), so the embedding table and the logits have the real model's size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memwall.planner.sources import embedded_model_path

TOKEN_UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def q4_1_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols/32 * 20] bytes: per 32 weights an fp16 scale d, an fp16 minimum m and 16
    bytes of 4-bit codes; w = d * q + m."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 20), dtype=np.uint8)
    d = rng.uniform(0.01, 0.02, blocks).astype(np.float16)
    out[:, 0:2] = d.view(np.uint8).reshape(blocks, 2)
    out[:, 2:4] = (-8 * d).view(np.uint8).reshape(blocks, 2)
    out[:, 4:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return out.reshape(rows, cols // 32 * 20)


def q8_0_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols/32 * 34] bytes: per 32 weights an fp16 scale and 32 int8 codes."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 34), dtype=np.uint8)
    out[:, 0:2] = np.full(blocks, 0.001, dtype=np.float16).view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(0, 256, (blocks, 32), dtype=np.uint8)
    return out.reshape(rows, cols // 32 * 34)


TokenizerFields = list[tuple[str, object, object, object]]
"""(key, value, GGUF value type, element type of an array) of every tokenizer.* key."""


def tokenizer_fields(source: Path | None = None, vocab: int | None = None) -> TokenizerFields:
    """Every tokenizer.* key of ``source`` (default: the embedded GGUF), the token list padded
    to ``vocab`` entries with unused tokens (None: as it is). (memwall's own GGUF reader: its
    fields are shaped like gguf.GGUFReader's, and it opens the file in 0.1 s.)"""
    import gguf

    from memwall.loader.gguf_loader import open_gguf

    fields = open_gguf(source or embedded_model_path()).fields
    size = len(fields["tokenizer.ggml.tokens"].data)
    if vocab is not None and vocab < size:
        raise ValueError(f"vocab {vocab} is smaller than the source tokenizer's {size} tokens")
    pad = (vocab or size) - size
    out: TokenizerFields = []
    for key, field in fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        values = [field.parts[i] for i in field.data]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                values = [bytes(v).decode("utf-8", errors="surrogateescape") for v in values]
            else:
                values = [v.tolist()[0] for v in values]
            if key == "tokenizer.ggml.tokens":
                values += [f"<|unused_{i}|>" for i in range(pad)]
            elif key == "tokenizer.ggml.token_type":
                values += [TOKEN_UNUSED] * pad
            elif key == "tokenizer.ggml.scores":
                values += [0.0] * pad
            out.append((key, values, vtype, sub))
        elif vtype == gguf.GGUFValueType.STRING:
            out.append((key, bytes(values[0]).decode("utf-8"), vtype, None))
        else:
            out.append((key, values[0].tolist()[0], vtype, None))
    return out


def vocab_size(fields: TokenizerFields) -> int:
    return next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")


def add_tokenizer(writer, fields: TokenizerFields) -> int:
    """Writes ``fields`` (tokenizer_fields) to a gguf.GGUFWriter; returns the vocabulary size."""
    for key, value, vtype, sub in fields:
        if sub is None:
            writer.add_key_value(key, value, vtype)
        else:
            writer.add_key_value(key, value, vtype, sub_type=sub)
    return vocab_size(fields)


def write(out: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
          vocab: int | None = None, seed: int = 0,
          tokenizer: TokenizerFields | None = None) -> Path:
    """Write the file; ``vocab`` None keeps the embedded tokenizer's 49,152 tokens.
    ``tokenizer``: tokenizer_fields() read once for several files (``vocab`` is then theirs)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"synthetic-llama-{hidden}x{layers}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    vocab = add_tokenizer(writer, tokenizer or tokenizer_fields(None, vocab))
    head_dim = hidden // heads
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tensor("token_embd.weight", q8_0_rows(rng, vocab, hidden), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", q4_1_rows(rng, rows, cols),
                              raw_dtype=Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
