"""Tokenizer.from_pretrained on Hugging Face directories, and what encode/decode promise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memwall.tokenizer import Tokenizer, TokenizerError

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Café naïve résumé — 日本語 🚀 emoji and 12345 numbers!",
    "def add(a, b):\n    return a + b\n",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer.json whose post-processor adds <s> (like many HF repos)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return backend.to_str()


def make_dir(root: Path, tokenizer_json: str, config: dict | None, **files: dict | str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(tokenizer_json)
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        path = root / name.replace("__", ".")
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return root


def test_loads_config_as_strings(tmp_path: Path, tokenizer_json: str) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML}
    tok = Tokenizer.from_pretrained(make_dir(tmp_path, tokenizer_json, config))
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.add_bos_token and tok.chat_template == CHATML
    assert tok.eos_token_ids == {1, 3}  # </s>, and <|im_end|> because the template ends turns with it
    assert set(range(len(SPECIALS))) <= tok.special_token_ids
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)


def test_loads_config_as_dicts_and_template_list(tmp_path: Path, tokenizer_json: str) -> None:
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "add_bos_token": False,
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}],
    }
    tok = Tokenizer.from_pretrained(make_dir(tmp_path, tokenizer_json, config))
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 4)
    assert tok.chat_template == CHATML and not tok.add_bos_token
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"name": "f"}]) == "TOOLS"


def test_generation_config_eos_list_and_special_tokens_map(tmp_path: Path, tokenizer_json: str) -> None:
    root = make_dir(tmp_path, tokenizer_json, {}, special_tokens_map__json={"bos_token": "<s>", "eos_token": "</s>"},
                    generation_config__json={"eos_token_id": [1, 4]})
    tok = Tokenizer.from_pretrained(root)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == {1, 4}
    assert tok.chat_template is None


def test_chat_template_jinja_file(tmp_path: Path, tokenizer_json: str) -> None:
    root = make_dir(tmp_path, tokenizer_json, {"eos_token": "</s>"}, chat_template__jinja=CHATML)
    tok = Tokenizer.from_pretrained(root)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_follows_the_post_processor_when_config_is_silent(tmp_path: Path, tokenizer_json: str) -> None:
    tok = Tokenizer.from_pretrained(make_dir(tmp_path, tokenizer_json, {"bos_token": "<s>"}))
    assert tok.add_bos_token


def test_encode_adds_bos_once_and_nothing_else(tmp_path: Path, tokenizer_json: str) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    tok = Tokenizer.from_pretrained(make_dir(tmp_path, tokenizer_json, config))
    plain = tok.encode("The fox", add_special_tokens=False)
    assert 0 not in plain
    assert tok.encode("The fox") == [0, *plain]
    assert tok.encode("<s>The fox") == [0, *plain]  # no double BOS
    assert tok.decode(tok.encode("The fox 🚀")) == "The fox 🚀"
    assert tok.decode(tok.encode("The fox"), skip_special_tokens=False) == "<s>The fox"
    assert tok.id_to_token(0) == "<s>" and tok.id_to_token(10**6) is None


def test_no_chat_template_error(tmp_path: Path, tokenizer_json: str) -> None:
    tok = Tokenizer.from_pretrained(make_dir(tmp_path, tokenizer_json, {"eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no tokenizer.json in"):
        Tokenizer.from_pretrained(tmp_path)


def test_broken_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_pretrained(tmp_path)


def test_matches_transformers_on_the_same_directory(tmp_path: Path, tokenizer_json: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    root = make_dir(tmp_path, tokenizer_json, config)
    ours, theirs = Tokenizer.from_pretrained(root), transformers.AutoTokenizer.from_pretrained(str(root))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café 🚀?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    for text in [*CORPUS, "<|im_start|>user\nhi<|im_end|>", "  two  spaces\n\n", ""]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
