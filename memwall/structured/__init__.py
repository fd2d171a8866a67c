"""Structured output: grammar-guided decoding (JSON schemas, regexes, choices, grammars).

    API side     StructuredOutputsParams (memwall/sampling_params.py), checked by ``check``
                 before the request is queued: a bad schema is a 400 naming the problem
    engine core  StructuredOutputManager.submit()   compiles off the step loop (a thread),
                                                    cached by the constraint's key
                 scheduler                           per step: GrammarState.bitmask() rows for
                                                    each constrained request (one per draft
                                                    position too), accept() the step's tokens
    worker       the sampler masks disallowed tokens to -inf before top-k/top-p (sample/
                 grammar_mask.py): greedy and sampled decoding both respect the grammar

Backends sit behind one small ABC (backend.py): llguidance (default) and xgrammar.
"""

from memwall.structured.backend import (BACKENDS, Grammar, GrammarBackend, GrammarError, check,
                                        make_backend)
from memwall.structured.manager import StructuredOutputManager
from memwall.structured.vocab import VocabInfo

__all__ = ["BACKENDS", "Grammar", "GrammarBackend", "GrammarError", "StructuredOutputManager",
           "VocabInfo", "check", "make_backend"]
