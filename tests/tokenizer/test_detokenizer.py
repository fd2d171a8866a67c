"""IncrementalDetokenizer on a small byte-level BPE: streaming text and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwall.sampling_params import SamplingParams
from memwall.tokenizer import IncrementalDetokenizer, Tokenizer

# No emoji or CJK here, so those come out as several byte tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Café naïve résumé, once upon a time in a land far away.",
    "Stop strings end generation: STOP here, or ### there, or at the end.",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def build_byte_level_dir(directory: Path) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_dir(tmp_path_factory.mktemp("bbpe")))


def stream(tok: Tokenizer, prompt, output, chunks=(1,), **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `output` in chunks of the given sizes (cycled); return the deltas, including the final one."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas, i, k = [], 0, 0
    while i < len(output):
        size = chunks[k % len(chunks)]
        detok.update(output[i : i + size])
        deltas.append(detok.get_delta(finished=False))
        i, k = i + size, k + 1
    deltas.append(detok.get_delta(finished=True))
    return deltas, detok


# -- text -----------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_sequences_stream_to_the_full_decode(tok: Tokenizer, data) -> None:
    ids = st.integers(0, tok.vocab_size - 1)
    prompt = data.draw(st.lists(ids, max_size=8), label="prompt")
    output = data.draw(st.lists(ids, min_size=1, max_size=30), label="output")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    deltas, detok = stream(tok, prompt, output, chunks, skip_special_tokens=skip)
    full = tok.decode(output, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_byte_tokens(tok: Tokenizer) -> None:
    output = tok.encode("fox 🚀 日本", add_special_tokens=False)
    assert len(output) >= 6  # the emoji and the CJK characters are several byte tokens each
    deltas, _ = stream(tok, tok.encode("The"), output)
    assert "".join(deltas) == "fox 🚀 日本"
    assert not any("\ufffd" in d for d in deltas)
    assert "🚀" in deltas and "本" in deltas  # each released whole, once complete


def test_incomplete_character_at_the_end_is_flushed(tok: Tokenizer) -> None:
    output = tok.encode("fox 🚀", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    deltas, detok = stream(tok, [], output)
    assert deltas[-1].endswith("\ufffd") and "".join(deltas) == tok.decode(output)


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    output = tok.encode("over<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, [], output)[0]) == "over"
    assert "".join(stream(tok, [], output, skip_special_tokens=False)[0]) == "over<|im_end|>"


def test_spaces_between_special_tokens_is_refused_by_name(tok: Tokenizer) -> None:
    # The `tokenizers` backend has no such option: kept special tokens touch their neighbours.
    output = tok.encode("<|im_start|>over<|im_end|></s>", add_special_tokens=False)
    text = "".join(stream(tok, [], output, skip_special_tokens=False)[0])
    assert text == "<|im_start|>over<|im_end|></s>"
    for value in (True, False):
        with pytest.raises(TypeError, match=r"spaces_between_special_tokens=.*not supported.*remove"):
            SamplingParams(spaces_between_special_tokens=value)


# -- stop strings ---------------------------------------------------------------------------------


def test_stop_string_split_across_tokens_is_found_and_cut(tok: Tokenizer) -> None:
    output = tok.encode("jumps over the lazy dog and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["lazy dog"])
    results = [detok.update([t]) for t in output]
    hit = results.index("lazy dog")
    assert all(r is None for r in results[:hit] + results[hit + 1 :])  # later tokens are ignored
    assert detok.output_text == "jumps over the "
    assert detok.matched_stop == "lazy dog"
    assert detok.get_delta(finished=False) == "jumps over the "


def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    output = tok.encode("jumps over the lazy dog and more", add_special_tokens=False)
    deltas, detok = stream(tok, [], output, stop=["lazy dog"], include_stop_str_in_output=True)
    assert detok.output_text == "".join(deltas) == "jumps over the lazy dog"


def test_possible_stop_start_is_held_back_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP here"])
    detok.update(tok.encode("a STO", add_special_tokens=False))
    assert detok.get_delta(finished=False) == "a "  # "STO" could become "STOP here"
    detok.update(tok.encode("P", add_special_tokens=False))
    assert detok.get_delta(finished=False) == ""  # "STOP" still could
    detok.update(tok.encode("!", add_special_tokens=False))
    assert detok.get_delta(finished=False) == "STOP!"  # no longer
    detok.update(tok.encode(" STOP", add_special_tokens=False))
    assert detok.get_delta(finished=False) == " "
    assert detok.get_delta(finished=True) == "STOP"  # the request ended without a match
    assert detok.output_text == "a STOP! STOP" and detok.matched_stop is None


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    output = tok.encode("once upon a time ### in a land STOP here", add_special_tokens=False)
    for stops in (["STOP", "###"], ["###", "STOP"]):
        deltas, detok = stream(tok, [], output, chunks=(len(output),), stop=stops)
        assert detok.matched_stop == "###" and detok.output_text == "".join(deltas) == "once upon a time "


def test_stop_found_in_text_released_at_the_finish(tok: Tokenizer) -> None:
    # "ab" then an incomplete emoji in one update: the text ends in U+FFFD and waits, so the stop
    # string in it is only seen when the request finishes.
    output = tok.encode("xab🚀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [], stop=["ab"])
    assert detok.update(output) is None
    assert detok.get_delta(finished=True) == "x"
    assert detok.matched_stop == "ab"


def reference_cut(text: str, stops: list[str], include: bool) -> str:
    """The text cut at the stop string that completes first (then the longest)."""
    hits = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    if not hits:
        return text
    end, neg_len, start = min(hits)
    return text[: end if include else start]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_stop_strings_do_not_depend_on_chunking(tok: Tokenizer, data) -> None:
    text = data.draw(st.text(alphabet="ab c🚀\n", min_size=1, max_size=25), label="text")
    output = tok.encode(text, add_special_tokens=False)
    stops = data.draw(st.lists(st.text(alphabet="ab c🚀\n", min_size=1, max_size=4), max_size=3), label="stops")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), label="chunks")
    include = data.draw(st.booleans(), label="include")
    deltas, detok = stream(tok, [], output, chunks, stop=stops, include_stop_str_in_output=include)
    assert detok.output_text == "".join(deltas) == reference_cut(text, stops, include)
