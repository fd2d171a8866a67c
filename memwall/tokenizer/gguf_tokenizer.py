"""Building a `tokenizers.Tokenizer` from the `tokenizer.ggml.*` metadata of a GGUF file.

A GGUF carries no tokenizer.json, only the pieces llama.cpp needs: the token strings, their types,
BPE merges or SentencePiece scores, and the name of a pre-tokenizer (`tokenizer.ggml.pre`). We
rebuild the equivalent Hugging Face pipeline from those:

* model "gpt2": byte-level BPE. `pre` names the regexes that cut text into words before merging;
  they are llama.cpp's, applied one after another (each splits the pieces the previous left), which
  is what a chain of `Split(..., "isolated")` pre-tokenizers does.
* model "llama": SentencePiece-style BPE over "▁"-for-space text, with <0xXX> byte-fallback tokens.
  Merges are usually absent and are rebuilt from the scores: merging into a higher-scored token
  comes first, as in SentencePiece.

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control tokens become special added tokens, user-defined ones plain added tokens, so both are
matched whole in text instead of being cut into pieces.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from memwall.tokenizer.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    import gguf

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp's word-splitting regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), by pre-tokenizer.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_SPLITS_BY_FAMILY: dict[tuple[str, ...], tuple[str, ...]] = {
    ("default",): _DEFAULT,
    ("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "trillion"): (_GPT2,),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
     "smaug-bpe"): (_LLAMA3,),
    ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan"): (_QWEN2,),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"): (r"\p{N}", _GPT2),
    ("falcon",): (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
}
PRE_TOKENIZER_SPLITS = {name: regexes for names, regexes in _SPLITS_BY_FAMILY.items() for name in names}
# llama.cpp matches a whole word against the vocabulary before merging for these ("ignore_merges").
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
# ... and adds BOS for these unless the file says otherwise.
_ADD_BOS_BY_DEFAULT = _IGNORE_MERGES


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The memwall Tokenizer for a GGUF file; TokenizerError when its tokenizer is unsupported."""
    meta = _TokenizerMetadata(reader)
    if meta.model == "gpt2":
        backend = _byte_level_bpe(meta)
    elif meta.model == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {meta.model!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}"
        )
    _add_special_tokens(backend, meta)
    extra_eos = [i for i in (meta.get("eot_token_id"), meta.get("eom_token_id")) if i is not None]
    return Tokenizer(
        backend,
        bos_token_id=meta.get("bos_token_id"),
        eos_token_id=meta.get("eos_token_id"),
        add_bos_token=meta.add_bos_token(),
        chat_template=_field(reader, "tokenizer.chat_template"),
        extra_eos_token_ids=extra_eos,
    )


# -- reading metadata --------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python data; works on gguf versions without ReaderField.contents()."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types:
        return default

    def as_str(part) -> str:
        return bytes(part).decode("utf-8", errors="replace")

    if field.types[0] == GGUFValueType.ARRAY:
        bulk = getattr(field.parts, "as_list", None)  # memwall's reader: the array in one pass
        if bulk is not None and len(field.types) == 2 and len(field.data) == len(field.parts):
            return bulk()
        if field.types[-1] == GGUFValueType.STRING:
            return [as_str(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == GGUFValueType.STRING:
        return as_str(field.parts[-1])
    return field.parts[-1].tolist()[0]


class _TokenizerMetadata:
    """The `tokenizer.ggml.*` fields, read once."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._reader = reader
        self.model: str | None = self.get("model")
        if self.model is None:
            raise TokenizerError("this GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        self.pre: str = self.get("pre") or "default"
        self.tokens: list[str] = self.get("tokens") or []
        if not self.tokens:
            raise TokenizerError("this GGUF file has no vocabulary (tokenizer.ggml.tokens is missing)")
        types = self.get("token_type")
        self.has_token_types = bool(types)
        self.token_types: list[int] = types or [TOKEN_NORMAL] * len(self.tokens)

    def get(self, name: str, default: Any = None) -> Any:
        return _field(self._reader, f"tokenizer.ggml.{name}", default)

    def add_bos_token(self) -> bool:
        """The file's flag, else llama.cpp's default: on for SentencePiece and for llama3-style BPE."""
        flag = self.get("add_bos_token")
        if flag is not None:
            return bool(flag)
        return self.model == "llama" or self.pre in _ADD_BOS_BY_DEFAULT

    def ids_of_type(self, *types: int) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t in types]


# -- gpt2: byte-level BPE ---------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that are not printable move up past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_bpe(meta: _TokenizerMetadata) -> HFTokenizer:
    splits = PRE_TOKENIZER_SPLITS.get(meta.pre)
    if splits is None:
        raise TokenizerError(
            f"GGUF pre-tokenizer {meta.pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    special = set(meta.ids_of_type(TOKEN_CONTROL, TOKEN_USER_DEFINED))
    vocab: dict[str, int] = {}
    for i, token in enumerate(meta.tokens):
        # A few converters store a normal token in plain text ("\n" instead of "Ċ"): respell it
        # in the byte alphabet so that merges reach it. Added tokens keep their text, they are
        # matched as-is.
        if i not in special and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or []]
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=meta.pre in _IGNORE_MERGES, fuse_unk=False)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


# -- llama: SentencePiece-style BPE -----------------------------------------------------------


def _sentencepiece_bpe(meta: _TokenizerMetadata) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for i, token in enumerate(meta.tokens):
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges") or []] or _merges_from_scores(meta, vocab)
    unk_id = meta.get("unknown_token_id")
    unk = meta.tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(meta.tokens) else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = HFTokenizer(model)
    prefix_space = bool(meta.get("add_space_prefix", True))
    # Like llama.cpp (and sentencepiece itself): every stretch of text between special tokens gets a
    # leading space, even one that already starts with a space, and then spaces become ▁. A
    # normalizer runs once per such stretch, which is exactly that. (transformers' GGUF loader uses
    # Metaspace(prepend_scheme="first") instead, which differs after special tokens and before a
    # leading space.)
    to_meta = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), to_meta]) if prefix_space else to_meta
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:  # take back the space the encoder put in front
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


MERGES_CACHE = Path(os.environ.get("MEMWALL_CACHE", Path.home() / ".cache" / "memwall")) / "merges"
MERGES_VERSION = 2  # bump when _derive_merges or the file's form changes: other versions are ignored


def _merges_from_scores(meta: _TokenizerMetadata, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``_derive_merges``, cached on disk by a hash of the vocabulary, scores and token types:
    deriving them takes seconds of Python for a 262k vocabulary (Gemma 3), reading them back a
    fraction of that. The same inputs give the same merges, so the cache cannot change a token."""
    scores = meta.get("scores") or [0.0] * len(meta.tokens)
    digest = hashlib.sha256(json.dumps([MERGES_VERSION, meta.tokens, scores, meta.token_types],
                                       ensure_ascii=False).encode()).hexdigest()
    path = MERGES_CACHE / f"{digest}.json"
    try:  # two flat lists of strings: json reads them ~3x faster than a list of pairs
        lefts, rights = json.loads(path.read_text())
        return list(zip(lefts, rights))
    except (OSError, ValueError, TypeError):
        pass
    merges = _derive_merges(meta, vocab, scores)
    try:  # a cache that cannot be written (read-only home) only costs the next load its time
        MERGES_CACHE.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps([[a for a, _ in merges], [b for _, b in merges]],
                                      ensure_ascii=False))
        partial.replace(path)
    except OSError:
        pass
    return merges


def _derive_merges(meta: _TokenizerMetadata, vocab: dict[str, int],
                   scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scored result first (ties: longer left part first, then file order).

    Only normal tokens take part: control, byte and unknown pieces never come out of merging text.
    """
    mergeable = {t for t, i in vocab.items() if meta.token_types[i] in (TOKEN_NORMAL, TOKEN_UNUSED)}
    candidates = []
    for token, index in vocab.items():
        if token not in mergeable:
            continue
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = [p for p in pairs if p[0] in mergeable and p[1] in mergeable]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates.extend((-scores[index], -len(left), -len(right), left, right) for left, right in pairs)
    # Stable sort on the score-and-length key only, so equal keys keep the order built above.
    candidates.sort(key=lambda c: c[:3])
    return [(c[3], c[4]) for c in candidates]


# -- added tokens ------------------------------------------------------------------------------


def _add_special_tokens(backend: HFTokenizer, meta: _TokenizerMetadata) -> None:
    """Control and unknown tokens as special added tokens; user-defined ones as plain added tokens.

    Only files without token types get BOS/EOS/... by id instead. Not the padding id, which some
    converters point at an ordinary token: marking that special would drop it from decoded text.
    """
    special_ids = set(meta.ids_of_type(TOKEN_CONTROL, TOKEN_UNKNOWN))
    if not meta.has_token_types:
        names = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id")
        special_ids |= {i for i in map(meta.get, names) if i is not None and 0 <= i < len(meta.tokens)}
    user_ids = [i for i in meta.ids_of_type(TOKEN_USER_DEFINED) if i not in special_ids]
    backend.add_special_tokens([AddedToken(meta.tokens[i], special=True, normalized=False)
                               for i in sorted(special_ids)])
    backend.add_tokens([AddedToken(meta.tokens[i], special=False, normalized=False) for i in user_ids])
