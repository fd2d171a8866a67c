"""xgrammar (MLC): the optional backend (``pip install xgrammar``; it pulls in torch and
transformers). Its per-token masks are precomputed per grammar state, so a step's mask is
cheaper than llguidance's; compiling costs more. ``grammar`` here is xgrammar's EBNF (GBNF-like).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xgrammar

from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.backend import Grammar, GrammarBackend, GrammarError
from memwall.structured.schema import with_integer_bounds
from memwall.structured.vocab import VocabInfo

MAX_JSON_WHITESPACE = 12  # see llguidance_backend.JSON_WHITESPACE


def tokenizer_info(vocab: VocabInfo) -> xgrammar.TokenizerInfo:
    """Token strings as the tokenizer stores them, and how to read bytes out of them: byte-level
    BPE (GPT-2 alphabet), SentencePiece with <0xNN> byte fallback, or raw."""
    spec = json.loads(vocab.tokenizer_json)
    ordered: dict[int, str] = {i: t for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        ordered[added["id"]] = added["content"]
    tokens = [ordered.get(i, "") for i in range(vocab.vocab_size)]
    decoder = json.dumps(spec.get("decoder") or {})
    if '"ByteLevel"' in decoder:
        kind = xgrammar.VocabType.BYTE_LEVEL
    elif '"ByteFallback"' in decoder or spec["model"].get("byte_fallback"):
        kind = xgrammar.VocabType.BYTE_FALLBACK
    else:
        kind = xgrammar.VocabType.RAW
    return xgrammar.TokenizerInfo(tokens, vocab_type=kind, vocab_size=vocab.vocab_size,
                                  stop_token_ids=list(vocab.eos_token_ids), add_prefix_space=False)


class XGrammarGrammar(Grammar):
    def __init__(self, vocab: VocabInfo, matcher: xgrammar.GrammarMatcher) -> None:
        super().__init__(vocab)
        self.matcher = matcher

    def accept(self, token_ids: list[int]) -> bool:
        for i, token in enumerate(token_ids):
            if not self.matcher.accept_token(token):
                self.matcher.rollback(i)  # all or nothing, as llguidance's consume_tokens
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: VocabInfo) -> None:
        super().__init__(vocab)
        self.compiler = xgrammar.GrammarCompiler(tokenizer_info(vocab), max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> Any:
        try:
            return _compile(self.compiler, params)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(_message(e)) from None

    def new_grammar(self, compiled: Any) -> Grammar:
        return XGrammarGrammar(self.vocab, xgrammar.GrammarMatcher(compiled))

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        try:
            _grammar(params)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(_message(e)) from None


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _compile(compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams):
    kind = params.kind
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(with_integer_bounds(params.json)),
                                            **_json_options(params))
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **_json_options(params))
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(_choice_ebnf(params.choice))
    return compiler.compile_grammar(params.grammar)


def _grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The same constraint parsed without a vocabulary (validation only)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = with_integer_bounds(params.json) if kind == "json" else {"type": "object"}
        return xgrammar.Grammar.from_json_schema(json.dumps(schema), **_json_options(params))
    if kind == "regex":
        return xgrammar.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgrammar.Grammar.from_ebnf(_choice_ebnf(params.choice))
    return xgrammar.Grammar.from_ebnf(params.grammar)


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _message(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
