"""The grammar backend ABC: compile a constraint once, then one ``Grammar`` (matcher state) per
request, advanced token by token and asked for the allowed-token bitmask each step.

A bitmask row holds ceil(vocab / 32) int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed (the layout llguidance and xgrammar both write).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.vocab import VocabInfo

# name -> "module:class"; imported on first use (xgrammar pulls in torch and transformers).
BACKENDS = {
    "llguidance": "memwall.structured.llguidance_backend:LLGuidanceBackend",
    "xgrammar": "memwall.structured.xgrammar_backend:XGrammarBackend",
}
DEFAULT_BACKEND = "llguidance"


class GrammarError(ValueError):
    """A schema, regex or grammar the backend refuses; the message names what (HTTP 400)."""


class Grammar(ABC):
    """One request's position in its grammar (memwall.request.GrammarState)."""

    def __init__(self, vocab: VocabInfo) -> None:
        self.vocab = vocab

    @abstractmethod
    def accept(self, token_ids: list[int]) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]``."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool: ...

    def valid_prefix(self, token_ids: list[int]) -> int:
        count = 0
        for token in token_ids:
            if not self.accept([token]):
                break
            count += 1
        self.rollback(count)
        return count

    def bitmask(self, draft_token_ids: list[int] = ()) -> np.ndarray:
        """Rows for the next token and for the one after each draft: the drafts are accepted
        one by one to reach each row's state, then rolled back. Rows after a draft the grammar
        refuses allow nothing (the scheduler sends only a valid prefix, see ``valid_prefix``;
        a refused token would leave an llguidance matcher in its error state for good)."""
        rows = np.zeros((1 + len(draft_token_ids), self.vocab.bitmask_words), dtype=np.int32)
        self.fill(rows, 0)
        valid = self.valid_prefix(list(draft_token_ids)) if draft_token_ids else 0
        for j, token in enumerate(draft_token_ids[:valid]):
            self.accept([token])
            self.fill(rows, j + 1)
        self.rollback(valid)
        return rows


class GrammarBackend(ABC):
    """Compiles constraints for one vocabulary. ``compile`` may take milliseconds to seconds:
    the manager calls it on its own thread, never in the step loop."""

    name: str

    def __init__(self, vocab: VocabInfo) -> None:
        self.vocab = vocab

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (shared by every request with the same key); GrammarError."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> Grammar:
        """A fresh matcher at the start of ``compiled``."""

    @staticmethod
    @abstractmethod
    def check(params: StructuredOutputsParams) -> None:
        """Raises GrammarError if the constraint cannot compile; needs no vocabulary (the API
        side calls it before queueing a request)."""


def backend_class(name: str) -> type[GrammarBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown structured-outputs backend {name!r}; choose one of "
                         f"{', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"the {name} backend needs the {e.name} package: pip install {name}") from None


def make_backend(name: str, vocab: VocabInfo) -> GrammarBackend:
    return backend_class(name)(vocab)


def check(params: StructuredOutputsParams, default_backend: str = DEFAULT_BACKEND) -> None:
    """GrammarError if ``params`` will not compile with the backend that will compile it."""
    backend_class(params.backend or default_backend).check(params)
