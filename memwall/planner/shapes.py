"""The shape of a dense decoder-only transformer, and what follows from it: parameter counts
and KV-cache values per token. Where shapes come from (an HF directory, a GGUF file, a built-in
name) is memwall/planner/sources.py; the built-in table is at the end of this file.

Parameters of one layer (H hidden, h heads, g KV heads, D head_dim, I intermediate):

    attention   q: H h D   k, v: H g D each   o: h D H      (+ (h + 2g) D biases: Qwen2)
                                                             (+ 2 D q/k norms: Qwen3, Gemma 3)
    MLP         gate, up: H I each   down: I H              (gated: Llama, Qwen, Gemma)
    norms       2 H (4 H with Gemma's sandwich norms)

plus the embedding V H, the LM head V H unless tied, and the final norm H.
Llama-3-8B: 32 x 218,112,000 + 2 x 525,336,576 + 4,096 = 8,030,261,248, the published count.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model's architecture (MoE is out of scope)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    """Gemma 3's 256 (1B-12B) differs from hidden / heads; so do Qwen3's."""
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int
    """The longest context memwall runs the model at (config max_position_embeddings, or a
    uniform sliding window that the engine caps the context at: Mistral-7B-v0.1's 4096)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name!r}: {name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: {self.heads} heads are not a multiple of "
                             f"{self.kv_heads} KV heads")

    # ---- parameters ----
    def attention_matrix_params(self) -> int:
        """q, k, v and o of one layer."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def layer_matrix_params(self) -> int:
        """The matrices of one layer: what a matmul reads per token, and what quantizes."""
        return self.attention_matrix_params() + self.mlp_params()

    def layer_vector_params(self) -> int:
        """Biases and norm weights of one layer (kept in the compute dtype)."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return bias + qk_norm + self.norms_per_layer * self.hidden

    def layer_params(self) -> int:
        return self.layer_matrix_params() + self.layer_vector_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The LM head's own weights: 0 when it is the embedding table (tied)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return (self.layers * self.layer_params() + self.embedding_params() + self.head_params()
                + self.hidden)

    @property
    def matmul_params(self) -> int:
        """Weights a decoded token multiplies by: every layer's matrices and the LM head (the
        embedding is a row lookup, not a matmul)."""
        return self.layers * self.layer_matrix_params() + self.vocab * self.hidden

    def kv_values_per_token(self) -> int:
        """K and V of every layer for one token: 2 L g D values."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def _shape(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
           tied: bool, ctx: int, head_dim: int | None = None, **extra) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv, head_dim or hidden // heads, inter, vocab,
                      tied, ctx, **extra)


_GEMMA3 = dict(qk_norm=True, norms_per_layer=4, model_type="gemma3_text")
_QWEN2 = dict(qkv_bias=True, model_type="qwen2")
# From each model's published config.json (the -Instruct / -it repositories share the base
# models' shapes). Gemma 3 4B-27B: the text decoder of the multimodal checkpoint (text_config;
# the ~0.4B vision tower is not counted). Qwen2.5: the Instruct configs' 32k window.
BUILTIN: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, False, 4096),
    _shape("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, False, 4096),
    _shape("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, False, 4096),
    _shape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, False, 8192),
    _shape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, False, 8192),
    _shape("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, False, 131072),
    _shape("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, False, 131072),
    _shape("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, False, 131072),
    _shape("mistral-7b-v0.1", 32, 4096, 32, 8, 14336, 32000, False, 4096, model_type="mistral"),
    _shape("mistral-7b-v0.3", 32, 4096, 32, 8, 14336, 32768, False, 32768, model_type="mistral"),
    _shape("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True, 32768, **_QWEN2),
    _shape("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True, 32768, **_QWEN2),
    _shape("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, True, 32768, **_QWEN2),
    _shape("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False, 32768, **_QWEN2),
    _shape("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False, 32768, **_QWEN2),
    _shape("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, False, 32768, **_QWEN2),
    _shape("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, False, 32768, **_QWEN2),
    _shape("gemma-3-1b", 26, 1152, 4, 1, 6912, 262144, True, 32768, head_dim=256, **_GEMMA3),
    _shape("gemma-3-4b", 34, 2560, 8, 4, 10240, 262208, True, 131072, head_dim=256, **_GEMMA3),
    _shape("gemma-3-12b", 48, 3840, 16, 8, 15360, 262208, True, 131072, head_dim=256, **_GEMMA3),
    _shape("gemma-3-27b", 62, 5376, 32, 16, 21504, 262208, True, 131072, head_dim=128, **_GEMMA3),
    _shape("smollm2-135m", 30, 576, 9, 3, 1536, 49152, True, 8192),
    _shape("smollm2-360m", 32, 960, 15, 5, 2560, 49152, True, 8192),
    _shape("smollm2-1.7b", 24, 2048, 32, 32, 8192, 49152, True, 8192),
)}
BUILTIN_ALIASES = {"mistral-7b": "mistral-7b-v0.1"}
