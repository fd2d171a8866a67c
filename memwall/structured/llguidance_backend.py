"""llguidance (Microsoft's guidance engine, Rust): the default backend.

Why the default: no dependencies, the widest JSON-schema support of the two (anyOf, patterns,
numeric bounds, $ref, formats), schemas compile in about a millisecond (it builds the lexer
lazily), and its Lark dialect embeds JSON schemas (``%json {...}``), which tool-call grammars
need. Measured against xgrammar in benchmarks/structured.py.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import numpy as np

from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.backend import Grammar, GrammarBackend, GrammarError
from memwall.structured.schema import with_integer_bounds
from memwall.structured.vocab import VocabInfo

# Whitespace a JSON value may carry between tokens. Unbounded ("any whitespace") lets a small
# model loop on newlines until max_tokens; a few characters is enough for pretty-printing.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,12}"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint in llguidance's grammar format (no vocabulary needed)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = with_integer_bounds(params.json) if kind == "json" else {"type": "object"}
        options = ({"whitespace_flexible": False} if params.disable_any_whitespace
                   else {"whitespace_pattern": JSON_WHITESPACE})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
    except ValueError as e:
        raise GrammarError(str(e)) from None


class LLGuidanceGrammar(Grammar):
    def __init__(self, vocab: VocabInfo, matcher: llguidance.LLMatcher) -> None:
        super().__init__(vocab)
        self.matcher = matcher

    def accept(self, token_ids: list[int]) -> bool:
        if self.matcher.is_stopped():
            # llguidance stops as soon as only EOS is allowed (the scheduler finishes the
            # request then); an EOS after that is still a valid end.
            return all(t in self.vocab.eos_token_ids for t in token_ids)
        return self.matcher.consume_tokens(list(token_ids)) and not self.matcher.is_error()

    def valid_prefix(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids))  # one call, state unchanged

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: VocabInfo) -> None:
        super().__init__(vocab)
        # ~0.2 s for a 49k vocabulary: built once, on the manager's thread.
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                                eos_token=list(vocab.eos_token_ids))

    def compile(self, params: StructuredOutputsParams) -> Any:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(_message(matcher.get_error()))
        return matcher  # each request gets a deep copy at the start state

    def new_grammar(self, compiled: Any) -> Grammar:
        return LLGuidanceGrammar(self.vocab, compiled.deep_copy())

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
        if error and not error.startswith("WARNING"):
            raise GrammarError(_message(error))


def _message(error: str) -> str:
    """llguidance's error as one line: its first line, plus the ``error: ...`` line a regex
    parse error puts below its caret diagram (the grammar excerpt after it is left out)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "the grammar does not compile"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} {detail.removeprefix('error:').strip()}" if detail else lines[0]
