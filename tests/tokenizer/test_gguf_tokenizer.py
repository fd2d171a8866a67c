"""The tokenizer built from GGUF metadata: byte-level BPE (model "gpt2") against transformers.

The embedded SmolLM2 GGUF is the real-world case; small hand-written GGUF files cover the
pre-tokenizer regexes and the error paths.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, pre_tokenizers

from memwall.tokenizer import Tokenizer, TokenizerError
from memwall.tokenizer.gguf_tokenizer import PRE_TOKENIZER_SPLITS

TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces and trailing   ",
    "multiple     spaces\tand\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "numbers 0 7 42 123 4567 3.14159 -12 1e10 2024-05-17",
    "emoji 🚀🔥 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Café naïve résumé façade Ærø Ångström",
    "Ελληνικά и русский текст",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "I'm sure you'll see they've done it, haven't they? 'S 'LL",
    "URL: https://example.com/path?q=1&r=two#frag",
    "JSON {\"key\": [1, 2, {\"nested\": null}]}",
    "    indented code block",
    "ALL CAPS SHOUTING!!!",
    "mixedCaseIdentifiers_with_underscores",
    "punctuation... ?!?! ;;; ::: --- ___",
    "math: ∑ x² ≤ ∞ ± √2",
    "",
    " ",
    "\n",
    "a",
    "ß",
    "tab\tseparated\tvalues\t1\t2",
    "😀 😃 😄 😁 😆",
    "The year 1999 and the number 1234567890",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
]


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    from memwall.loader.gguf_file import GGUFFile  # the reader memwall loads models with

    return Tokenizer.from_gguf(GGUFFile(gguf_path))


@pytest.fixture(scope="module")
def theirs(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    from tests.gguf_oracle import remembered_gguf_parsing

    with remembered_gguf_parsing():
        return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# -- SmolLM2, against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, theirs, text: str) -> None:
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def test_decode_matches_transformers(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        for skip in (False, True):
            expected = theirs.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == expected


def test_smollm2_metadata(ours: Tokenizer, theirs) -> None:
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    im_end = ours.backend.token_to_id("<|im_end|>")
    assert im_end in ours.eos_token_ids
    assert ours.add_bos_token is False  # the file says so: the chat template writes its own markers
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)
    # control tokens are special: skipped on decode, never cut into pieces on encode
    assert {0, 1, 2} <= ours.special_token_ids
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert ours.id_to_token(905) == "Ġworld"


CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4. 🚀"},
    {"role": "user", "content": "And in Japanese? 日本語で"},
]


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, theirs, system, add_generation_prompt) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ("You are a helpful AI assistant named SmolLM" in rendered) == (system is None)
    assert ours.encode(rendered) == theirs.encode(rendered, add_special_tokens=False)


# -- pre-tokenizer regexes, against the regexes in the models' own tokenizer.json --------------

_HF_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HF_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


REFERENCE_PRE_TOKENIZERS = {
    "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama-bpe": _split_then_bytes(_HF_LLAMA3),
    "qwen2": _split_then_bytes(_HF_QWEN2),
    # SmolLM2's tokenizer.json: single digits first, then GPT-2's byte-level regex.
    "smollm": pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}


def byte_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_gguf(path: Path, *, model: str = "gpt2", pre: str | None = "gpt-2", tokens=None, types=None,
               merges=None, **flags) -> Path:
    """A GGUF file with only tokenizer metadata (no tensors); by default all 256 byte tokens + <|end|>."""
    tokens = tokens or byte_alphabet() + ["<|end|>"]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if types is not False:  # False: an old file without token types
        writer.add_token_types(types or [1] * (len(tokens) - 1) + [3])
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    for name, value in flags.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", sorted(REFERENCE_PRE_TOKENIZERS))
def test_pre_tokenizer_regexes_match_reference(tmp_path: Path, pre: str) -> None:
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / "t.gguf", pre=pre)))
    reference = REFERENCE_PRE_TOKENIZERS[pre]
    for text in TEXTS:
        words = [w for w, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]
        assert words == [w for w, _ in reference.pre_tokenize_str(text)], text


def test_every_named_pre_tokenizer_compiles(tmp_path: Path) -> None:
    for pre in sorted(PRE_TOKENIZER_SPLITS):
        tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / f"{pre}.gguf", pre=pre)))
        assert tokenizer.decode(tokenizer.encode("It's 2024: déjà vu!\n")) == "It's 2024: déjà vu!\n"


def test_default_pre_tokenizer_is_llama_cpp_default(tmp_path: Path) -> None:
    for pre in ("default", None):  # a missing `pre` means "default" in llama.cpp too
        tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / "d.gguf", pre=pre)))
        words = [w for w, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str("ab, 12345!")]
        assert words == ["ab", ",", "Ġ", "123", "45", "!"]


def test_merges_and_added_tokens(tmp_path: Path) -> None:
    tokens = byte_alphabet() + ["Ġh", "Ġhi", "<think>", "<|end|>"]
    types = [1] * (len(tokens) - 2) + [4, 3]
    path = write_gguf(tmp_path / "m.gguf", tokens=tokens, types=types, merges=["Ġ h", "Ġh i"], add_bos_token=False)
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path))
    hi, think, end = (tokens.index(t) for t in ("Ġhi", "<think>", "<|end|>"))
    assert tokenizer.encode("a hi<think>b<|end|>") == [tokens.index("a"), hi, think, tokens.index("b"), end]
    assert end in tokenizer.special_token_ids and think not in tokenizer.special_token_ids
    assert tokenizer.decode([hi, think, end]) == " hi<think>"  # user-defined text stays, control goes
    assert tokenizer.eos_token_ids == {end}


def test_special_tokens_without_token_types(tmp_path: Path) -> None:
    tokens = byte_alphabet() + ["<|end|>"]
    path = write_gguf(tmp_path / "o.gguf", tokens=tokens, types=False, pad_token_id=tokens.index("!"))
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path))
    end = len(tokens) - 1
    assert tokenizer.encode("hi!<|end|>", add_special_tokens=False)[-1] == end  # EOS, found by id
    assert tokenizer.special_token_ids == {end}  # the padding id points at "!": it stays ordinary
    assert tokenizer.decode(tokenizer.encode("hi!<|end|>")) == "hi!"


def test_add_bos_defaults_follow_llama_cpp(tmp_path: Path) -> None:
    def bos_flag(**kwargs) -> bool:
        path = write_gguf(tmp_path / "b.gguf", bos_token_id=0, **kwargs)
        return Tokenizer.from_gguf(gguf.GGUFReader(path)).add_bos_token

    assert bos_flag(pre="gpt-2") is False
    assert bos_flag(pre="llama-bpe") is True
    assert bos_flag(pre="llama-bpe", add_bos_token=False) is False


def test_unsupported_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="'bert'.*gpt2, llama"):
        Tokenizer.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / "u.gguf", model="bert")))


def test_unsupported_pre_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="pre-tokenizer 'made-up'"):
        Tokenizer.from_gguf(gguf.GGUFReader(write_gguf(tmp_path / "p.gguf", pre="made-up")))
