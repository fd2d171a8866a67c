"""VocabInfo: what a grammar backend needs to know of the model's vocabulary (plain data: it
crosses from the worker, which loaded the tokenizer, to the engine core, which compiles)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VocabInfo:
    tokenizer_json: str
    """The `tokenizers` tokenizer serialized (``Tokenizer.to_str()``): backends read every
    token's bytes from it."""
    vocab_size: int
    """Width of the model's logits (may exceed the tokenizer's vocabulary: padding rows)."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation: a grammar allows them where it may end."""

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32
