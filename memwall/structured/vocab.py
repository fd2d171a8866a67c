"""VocabInfo: what a grammar backend needs to know of the model's vocabulary. It crosses from
the worker, which loaded the tokenizer, to the engine core, which compiles; a
``tokenizers.Tokenizer`` pickles (as its JSON), so it stays plain data across processes."""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers


@dataclass(frozen=True)
class VocabInfo:
    tokenizer: tokenizers.Tokenizer
    """The model's `tokenizers` tokenizer: backends read every token's bytes from its JSON."""
    vocab_size: int
    """Width of the model's logits (may exceed the tokenizer's vocabulary: padding rows)."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation: a grammar allows them where it may end."""

    @property
    def tokenizer_json(self) -> str:
        """Serialized only when a backend is built (the first constrained request, or a
        server's warm-up): for a 262k vocabulary it is 0.3 s and ~50 MB that an engine without
        structured outputs should not spend."""
        return self.tokenizer.to_str()

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32
