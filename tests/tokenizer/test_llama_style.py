"""SentencePiece-style vocabularies (GGUF model "llama"): ▁ for spaces, <0xXX> byte fallback.

A small sentencepiece BPE model is trained here and written to a GGUF the way llama.cpp's
converter does (tokens, scores, token types, no merges); sentencepiece itself is the reference.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import gguf
import pytest

from memwall.tokenizer import IncrementalDetokenizer, Tokenizer

spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Say hi to the world.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "def add(a, b):\n    return a + b",
    "Once upon a time there lived a small model that wanted to be fast.",
    "Café naïve résumé",
    "numbers 12345 and 678",
]
SPECIALS = ("<|im_start|>", "<|im_end|>")
PROBES = [
    "Hello world", " two  spaces", "Café 🚀 日本語", "numbers 12345", "\n\nx", "hello\tthere",
    "The lazy dog jumps over the quick brown fox", "a  b   c    d", "trailing ", "ÆØÅ ß ŧ", "",
]


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    return 4 if sp.id_to_piece(i) in SPECIALS else 1


def train_sentencepiece():
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, hard_vocab_limit=False, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=list(SPECIALS), minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_spm_gguf(sp, path: Path, add_space_prefix: bool = True) -> Path:
    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([_token_type(sp, i) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece()


@pytest.fixture(scope="module")
def tok(sp, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(write_spm_gguf(sp, tmp_path_factory.mktemp("spm") / "spm.gguf")))


def random_texts(seed: int, count: int) -> list[str]:
    """Random strings over the corpus characters plus a few the vocabulary only has as bytes."""
    alphabet = sorted(set("".join(CORPUS))) + list("🚀日本語😀\t") + ["  ", "\n"]
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(count)]


def test_encode_matches_sentencepiece(tok: Tokenizer, sp) -> None:
    for text in PROBES + random_texts(0, 300):
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), repr(text)


def test_decode_matches_sentencepiece(tok: Tokenizer, sp) -> None:
    for text in PROBES + random_texts(1, 100):
        ids = sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids) == text


def test_byte_fallback_tokens(tok: Tokenizer, sp) -> None:
    ids = tok.encode("🚀", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids[1:]] == ["<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    assert tok.decode(ids[:3]) == "\ufffd\ufffd"  # an incomplete character, like sentencepiece


def test_special_tokens_get_a_space_after_them_like_llama_cpp(tok: Tokenizer, sp) -> None:
    """llama.cpp prefixes every stretch of text after a special token with a space."""
    start, end = (tok.backend.token_to_id(t) for t in SPECIALS)
    ids = tok.encode("<|im_start|>Hello there<|im_end|>")
    assert ids == [sp.bos_id(), start, *sp.encode("Hello there"), end]
    assert tok.eos_token_ids == {sp.eos_id(), end}  # the chat template ends turns with <|im_end|>


def test_bos_is_added_once(tok: Tokenizer, sp) -> None:
    assert tok.add_bos_token  # llama.cpp's default for SentencePiece vocabularies
    assert tok.encode("Hello") == [sp.bos_id(), *sp.encode("Hello")]
    with_bos = tok.encode("<s>Hello")
    assert with_bos[0] == sp.bos_id() and with_bos.count(sp.bos_id()) == 1


def test_without_space_prefix(sp, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(gguf.GGUFReader(write_spm_gguf(sp, tmp_path / "n.gguf", add_space_prefix=False)))
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert not tok.id_to_token(ids[0]).startswith("▁")
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(tok.encode(" x", add_special_tokens=False)) == " x"


# -- streaming with ▁ tokens ---------------------------------------------------------------------


def stream(tok: Tokenizer, prompt: list[int], output: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = []
    for i in range(0, len(output), chunk):
        detok.update(output[i : i + chunk])
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == detok.output_text
    return deltas


def test_streaming_keeps_the_spaces_between_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode("Say hi")
    output = tok.encode("Say hi to the world there", add_special_tokens=False)[len(prompt) - 1 :]
    assert tok.id_to_token(output[0]).startswith("▁")
    naive = "".join(tok.decode([i]) for i in output)
    assert naive.count(" ") == 0  # why the detokenizer exists: each ▁ alone decodes to nothing
    deltas = stream(tok, prompt, output)
    # the first output token keeps the space it carries after the prompt
    assert "".join(deltas) == " to the world there"
    assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)) :]


def test_streaming_without_prompt_equals_decode(tok: Tokenizer) -> None:
    output = tok.encode("Hello world 🚀 there", add_special_tokens=False)
    deltas = stream(tok, [], output)
    assert "".join(deltas) == tok.decode(output) == "Hello world 🚀 there"
    assert all("\ufffd" not in d for d in deltas)
    # held back over its four byte tokens (and the next token: another byte token could still
    # have turned the run into U+FFFD), then released whole
    assert any("🚀" in d for d in deltas)


def test_streaming_random_sequences(tok: Tokenizer) -> None:
    rng = random.Random(7)
    prompt = tok.encode("Once upon a time")
    for _ in range(200):
        output = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        deltas = stream(tok, prompt, output, chunk=rng.randint(1, 4))
        full = tok.decode(prompt + output)
        assert "".join(deltas) == full[len(tok.decode(prompt)) :]
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)


def test_merges_cache_gives_the_same_tokenizer(sp, tmp_path, monkeypatch) -> None:
    """Derived merges are cached by a hash of the vocabulary: the second load reads them back
    (equal tokens), and a damaged cache file is derived again, never trusted."""
    from memwall.tokenizer import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "MERGES_CACHE", tmp_path / "merges")
    path = write_spm_gguf(sp, tmp_path / "spm.gguf")
    first = Tokenizer.from_gguf(gguf.GGUFReader(path))
    (cached,) = (tmp_path / "merges").iterdir()
    derive = gguf_tokenizer._derive_merges
    monkeypatch.setattr(gguf_tokenizer, "_derive_merges", lambda *a: pytest.fail("not read back"))
    second = Tokenizer.from_gguf(gguf.GGUFReader(path))
    texts = PROBES + random_texts(5, 100)
    assert [second.encode(t) for t in texts] == [first.encode(t) for t in texts]
    cached.write_text("[[\"truncated")
    monkeypatch.setattr(gguf_tokenizer, "_derive_merges", derive)
    third = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert [third.encode(t) for t in texts] == [first.encode(t) for t in texts]
