"""transformers as the GGUF oracle, loaded faster: it parses the file once per object it builds
(config, weights, tokenizer) and rebuilds gguf's tensor-name table once per tensor (~25 of the
~50 s it takes to load the embedded model on 2 cores). Both are pure, so they are remembered
while it loads: the same weights and vocabulary come out."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def remembered_gguf_parsing() -> Iterator[None]:
    import gguf

    with (mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
          mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))):
        yield
