"""The models a server answers to: the base model's served names, and LoRA adapters by name.

A request's ``model`` picks what runs it (vLLM's interface):

    a served name of the base model   ->  the base model (no adapter)
    a loaded adapter's name           ->  its LoRARequest, passed to the engine with the request
    anything else                     ->  404 (model_not_found)

Adapters come from ``--lora-modules name=path`` at start-up and ``POST /v1/load_lora_adapter``
at run time; ``POST /v1/unload_lora_adapter`` forgets a name at once (later requests naming it
get 404) and tells the engine core, which drops the weights once the requests already running
with them end. Every load is checked here first, against the model's shapes and
``--max-lora-rank`` (a bad adapter is a 400 with the reason, never a failure inside the engine),
by reading it on a thread (the event loop keeps serving). Each load gets a fresh ``lora_int_id``,
so a reload under the same name with new weights is a new adapter to the engine: its prefix-cache
namespace is new too, and no request meets KV computed with the old weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from memwall.engine.async_engine import AsyncLLMEngine
from memwall.entrypoints.openai.errors import APIError, bad_request
from memwall.entrypoints.openai.protocol import ModelCard
from memwall.lora.request import LoRARequest

logger = logging.getLogger("memwall.server")
LORA_DISABLED = "LoRA is not enabled (--enable-lora)"
LISTED_IN_404 = 8
"""Most adapter names a 404 lists (beyond it: a count and GET /v1/models)."""


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None
    """The base model the adapter says it belongs to (/v1/models' parent); default: the server's."""


def parse_lora_modules(values: list[str]) -> list[LoRAModulePath]:
    """``--lora-modules`` values: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...,
    "base_model_name": ...}``. ValueError (one line) for a malformed one or a repeated name."""
    modules: list[LoRAModulePath] = []
    for value in values:
        module = _parse_lora_module(value.strip())
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        modules.append(module)
    return modules


def _parse_lora_module(value: str) -> LoRAModulePath:
    if value.startswith("{"):
        try:
            body = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from None
        name, path, base = (body.get("name"), body.get("path"), body.get("base_model_name")
                            ) if isinstance(body, dict) else (None, None, None)
        if not (isinstance(name, str) and name and isinstance(path, str) and path) or (
                base is not None and not isinstance(base, str)):
            raise ValueError(f"--lora-modules {value!r}: the JSON form needs string fields "
                             '"name" and "path" (and optionally "base_model_name")')
        return LoRAModulePath(name, path, base)
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                         '{"name": ..., "path": ...}')
    return LoRAModulePath(name, path)


@dataclass(frozen=True)
class _Adapter:
    lora: LoRARequest
    parent: str


class OpenAIServingModels:
    """The base model's names and the loaded adapters (touched only on the event loop, and at
    start-up before it runs)."""

    def __init__(self, engine: AsyncLLMEngine, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = list(base_names)
        self._adapters: dict[str, _Adapter] = {}
        self._loading: set[str] = set()  # names being checked on a thread right now
        self._ids = itertools.count(1)

    # ---- what the engine takes ---------------------------------------------------------------
    @property
    def max_lora_rank(self) -> int | None:
        """None: the engine serves no adapters (started without --enable-lora)."""
        info = self.engine.core_info
        return None if info is None else info.max_lora_rank

    @property
    def lora_enabled(self) -> bool:
        return self.max_lora_rank is not None

    # ---- requests ----------------------------------------------------------------------------
    def resolve(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to echo in the response, the adapter to run with); 404 for a name this
        server does not serve."""
        if name is None or name in self.base_names:
            return name or self.base_names[0], None
        adapter = self._adapters.get(name)
        if adapter is not None:
            return name, adapter.lora
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{self._served_text()}", "model", "model_not_found")

    def _served_text(self) -> str:
        text = ", ".join(map(repr, self.base_names))
        names = list(self._adapters)
        if len(names) > LISTED_IN_404:
            return f"{text} and {len(names)} LoRA adapters (GET /v1/models lists them)"
        if names:
            return f"{text} and the LoRA adapters {', '.join(map(repr, names))}"
        return text

    def cards(self, max_model_len: int) -> list[ModelCard]:
        """/v1/models: each base name, then each adapter (root: its path, parent: its base)."""
        root = self.engine.model_name
        cards = [ModelCard(id=name, max_model_len=max_model_len, root=root)
                 for name in self.base_names]
        cards += [ModelCard(id=name, max_model_len=max_model_len, root=a.lora.lora_path,
                            parent=a.parent) for name, a in self._adapters.items()]
        return cards

    def lora_requests(self) -> list[LoRARequest]:
        return [a.lora for a in self._adapters.values()]

    # ---- loading and unloading ---------------------------------------------------------------
    def add_startup(self, module: LoRAModulePath) -> LoRARequest:
        """A ``--lora-modules`` adapter, checked before the server starts; LoRAError (a
        ValueError, one line) when it cannot be served."""
        if not self.lora_enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        conflict = self._name_conflict(module.name)
        if conflict is not None:
            raise ValueError(f"--lora-modules: {conflict}")
        self._check_adapter(module.name, module.path)
        return self._register(module.name, module.path, module.base_model_name)

    async def load(self, name: str, path: str) -> LoRARequest:
        """POST /v1/load_lora_adapter: 400 naming what is wrong (LoRA off, the name taken, a
        path that is not there, missing tensors, a rank above --max-lora-rank, shapes that do
        not fit the model)."""
        if not self.lora_enabled:
            raise bad_request(LORA_DISABLED, code="lora_disabled")
        conflict = self._name_conflict(name)
        if conflict is not None:
            raise bad_request(conflict, "lora_name", "lora_name_taken")
        self._loading.add(name)
        try:
            await asyncio.to_thread(self._check_adapter, name, path)
        except ValueError as e:  # LoRAError: the reason, as the client should see it
            raise bad_request(str(e), "lora_path", "invalid_lora_adapter") from None
        finally:
            self._loading.discard(name)
        lora = self._register(name, path)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora.lora_int_id)
        return lora

    def unload(self, name: str) -> LoRARequest:
        """POST /v1/unload_lora_adapter: later requests naming it get 404; the engine drops its
        weights once the requests running with it end. 404 for a name that is not loaded."""
        if not self.lora_enabled:
            raise bad_request(LORA_DISABLED, code="lora_disabled")
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", "lora_name",
                           "lora_not_found")
        self.engine.remove_lora(adapter.lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded (id %d)", name, adapter.lora.lora_int_id)
        return adapter.lora

    def _name_conflict(self, name: str) -> str | None:
        """Why an adapter cannot take this name, or None when it can."""
        if name in self.base_names:
            return f"the name {name!r} is the base model's; give the adapter another"
        if name in self._adapters or name in self._loading:
            return (f"a LoRA adapter named {name!r} is already loaded; unload it first "
                    "(POST /v1/unload_lora_adapter)")
        return None

    def _check_adapter(self, name: str, path: str) -> None:
        """Reads the adapter as the workers will and checks it against the model (runs on a
        thread: it reads files and builds tensors). Raises ValueError (LoRAError) with the
        reason; a file that breaks the reader in some other way says so too."""
        from memwall.lora.adapter import LoRAError
        from memwall.lora.peft import load_adapter
        from memwall.lora.slots import base_config, check_adapter

        info = self.engine.core_info
        arch, max_rank = info.arch, info.max_lora_rank
        try:
            adapter = load_adapter(path, name, base_config(arch))
        except LoRAError:
            raise
        except OSError as e:
            raise LoRAError(f"adapter {name!r}: cannot read {str(Path(path))!r} "
                            f"({e.strerror or e})") from None
        except Exception as e:  # noqa: BLE001 - a malformed file can fail a reader anywhere
            logger.warning("LoRA adapter %r at %s cannot be read", name, path, exc_info=True)
            raise LoRAError(f"adapter {name!r}: {str(Path(path))!r} cannot be read as a LoRA "
                            f"adapter ({type(e).__name__}: {e})") from None
        check_adapter(adapter, arch, max_rank)

    def _register(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        lora = LoRARequest(name, next(self._ids), path)
        self._adapters[name] = _Adapter(lora, parent or self.base_names[0])
        return lora
