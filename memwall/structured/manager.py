"""StructuredOutputManager: compiles constraints off the step loop and hands out grammars.

    submit(params)  -> PendingGrammar   the compile is queued on the manager's thread (llguidance
                                        and xgrammar release the GIL while they compile), or
                                        found in the cache: same key, same compiled grammar
    pending.ready                        the engine core admits the request once true ...
    take(pending)   -> Grammar           ... with a fresh matcher, or GrammarError

So a request with a never-seen schema waits for its own compile while every other request keeps
stepping. The backend itself (the vocabulary's token table: 0.2 s and ~25 MB for 49k tokens,
3 s and ~300 MB for 262k) is built on that thread too: at start-up with ``warmup`` (servers,
so the first constrained request does not wait for it), else with the first compile.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.backend import DEFAULT_BACKEND, Grammar, GrammarBackend, make_backend
from memwall.structured.vocab import VocabInfo

CACHE_SIZE = 512  # compiled grammars kept (least recently used dropped first)


@dataclass
class CompileStats:
    num_compiled: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0


@dataclass
class PendingGrammar:
    backend: str
    compiled: Future

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def wait(self, timeout: float) -> None:
        try:
            self.compiled.exception(timeout=timeout)
        except TimeoutError:
            pass


class StructuredOutputManager:
    def __init__(self, vocab: VocabInfo, backend: str = DEFAULT_BACKEND,
                 cache_size: int = CACHE_SIZE, warmup: bool = False) -> None:
        self.vocab = vocab
        self.default_backend = backend
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memwall-grammar")
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        if warmup:
            self._thread.submit(self._backend, backend)  # in the background

    def _backend(self, name: str) -> GrammarBackend:
        """On the manager's thread only: the backends dict is written nowhere else."""
        backend = self._backends.get(name)
        if backend is None:
            backend = self._backends[name] = make_backend(name, self.vocab)
        return backend

    def submit(self, params: StructuredOutputsParams) -> PendingGrammar:
        name = params.backend or self.default_backend
        key = (name, *params.key)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.stats.num_cache_hits += 1
        else:
            compiled = self._thread.submit(self._compile, name, params)
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return PendingGrammar(name, compiled)

    def take(self, pending: PendingGrammar) -> Grammar:
        """A fresh matcher; raises the compile's GrammarError (call once ``ready``)."""
        compiled = pending.compiled.result()
        return self._backends[pending.backend].new_grammar(compiled)

    def _compile(self, name: str, params: StructuredOutputsParams):
        start = time.perf_counter()
        compiled = self._backend(name).compile(params)
        self.stats.num_compiled += 1
        self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
