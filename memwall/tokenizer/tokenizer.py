"""The tokenizer an engine talks to: a `tokenizers.Tokenizer` plus the metadata around it.

Two sources are supported:

* a Hugging Face model directory (`tokenizer.json` + `tokenizer_config.json` and friends), and
* a GGUF file, whose metadata describes the vocabulary (see `gguf_tokenizer.py`).

Both end up as the same `Tokenizer`, so nothing downstream cares where the vocabulary came from.
We never call the backend's post-processor: the only special token an engine adds to a plain prompt
is BOS, and whether to add it is one explicit flag (`add_bos_token`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

if TYPE_CHECKING:  # gguf is only needed when loading a GGUF file
    import gguf

# SentencePiece's byte-fallback pieces, <0x00> .. <0xFF>.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma). A model's
# config often names only the end-of-*text* token as EOS, so generation would run past the turn.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class TokenizerError(ValueError):
    """A problem with a tokenizer or a chat template; the message is one line meant for users."""


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` plus the metadata an engine needs.

    Contract: `encode` adds at most one special token (BOS, when `add_bos_token`), `decode` is the
    backend's decode, and `eos_token_ids` is every id that should end generation.
    """

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]
    add_bos_token: bool
    chat_template: str | None
    special_token_ids: frozenset[int]
    vocab_size: int

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
        named_chat_templates: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = bool(add_bos_token and bos_token_id is not None)
        self.chat_template = chat_template
        # Extra templates some repos ship next to the default one, e.g. {"tool_use": ...}.
        self.named_chat_templates = dict(named_chat_templates or {})
        self.bos_token = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = self.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(self._special_ids())
        self.eos_token_ids = frozenset(self._stop_ids(extra_eos_token_ids))

    # -- metadata ---------------------------------------------------------------------------

    def _special_ids(self) -> set[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        return ids | {i for i in (self.bos_token_id, self.eos_token_id) if i is not None}

    def _stop_ids(self, extra: Iterable[int]) -> set[int]:
        ids = {int(i) for i in extra}
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        templates = [t for t in (self.chat_template, *self.named_chat_templates.values()) if t]
        for token in END_OF_TURN_TOKENS:
            token_id = self.backend.token_to_id(token)
            # Only when the chat format really ends turns with it: "<|end|>" may mean something else.
            if token_id is not None and any(token in t for t in templates):
                ids.add(token_id)
        return ids

    @functools.cached_property
    def byte_fallback_token_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte tokens (<0x00>..<0xFF>) when the model falls back to bytes.

        Their decoder turns a whole run of them into U+FFFD when the run is not valid UTF-8, so
        streaming must not cut such a run in two (see IncrementalDetokenizer).
        """
        model = self.backend.model
        if not getattr(model, "byte_fallback", False):
            return frozenset()
        return frozenset(i for token, i in self.backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(token))

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS first when `add_bos_token`.

        Never two BOS: text that already starts with the BOS string gets no second one.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            starts_with_bos = (ids and ids[0] == self.bos_token_id) or (
                self.bos_token is not None and text.startswith(self.bos_token)
            )
            if not starts_with_bos:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids the vocabulary does not know are skipped."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's spelling of token `i` (e.g. 'Ġhello'), or None when out of range."""
        return self.backend.id_to_token(int(i))

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **extra: Any
    ) -> str:
        """The prompt string for a conversation, rendered with this model's chat template."""
        from memwall.tokenizer.chat_template import render_chat_template

        template = self.chat_template
        if tools and "tool_use" in self.named_chat_templates:
            template = self.named_chat_templates["tool_use"]
        return render_chat_template(
            template,
            messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **extra,
        )

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (needs `tokenizer.json`, a "fast" tokenizer)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {directory}: memwall needs a fast tokenizer file "
                "(convert a slow one with transformers' AutoTokenizer(...).save_pretrained)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust error text is long; keep ours to one line
            raise TokenizerError(f"cannot read {tokenizer_file}: {str(exc).splitlines()[0]}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        bos_id = _token_id(backend, config.get("bos_token", special_map.get("bos_token")))
        eos_id = _token_id(backend, config.get("eos_token", special_map.get("eos_token")))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        default_template, named = _chat_templates(directory, config)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            add_bos_token=bool(add_bos),
            chat_template=default_template,
            extra_eos_token_ids=_generation_eos_ids(directory),
            named_chat_templates=named,
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file's `tokenizer.*` metadata describes."""
        from memwall.tokenizer.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(reader)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos_token={self.add_bos_token})"
        )


# -- helpers for from_pretrained -------------------------------------------------------------


def _read_json(path: Path) -> dict:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    """Id of a special token given as a string or as HF's {"content": ...} form."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return backend.token_to_id(token)


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether the tokenizer.json post-processor prepends BOS (used when the config does not say)."""
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return bool(with_special) and with_special[0] == bos_id and (not without or without[0] != bos_id)


def _chat_templates(directory: Path, config: dict) -> tuple[str | None, dict[str, str]]:
    """(default template, named templates) from the places HF has stored them over the years.

    Newer checkpoints keep the template in `chat_template.jinja`; older ones in
    `tokenizer_config.json` (a string, or a list of {"name", "template"}) or `chat_template.json`.
    """
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), {}
    raw = config.get("chat_template")
    if raw is None:
        raw = _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(raw, str):
        return raw, {}
    if isinstance(raw, list):
        named = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t and "template" in t}
        default = named.get("default", next(iter(named.values()), None))
        return default, named
    return None, {}


def _generation_eos_ids(directory: Path) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), else from config.json."""
    generation = _read_json(directory / "generation_config.json")
    value = generation.get("eos_token_id") if generation else _read_json(directory / "config.json").get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
