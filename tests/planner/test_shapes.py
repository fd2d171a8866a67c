"""Model shapes: published parameter counts and KV figures, the three sources (built-in name,
HF directory, GGUF file) and the embedded GGUF's exact weight bytes."""

from __future__ import annotations

import json

import pytest

from memwall.planner.precision import kv_bytes_per_token_head
from memwall.planner.shapes import BUILTIN
from memwall.planner.sources import builtin_key, from_gguf, resolve_model

PUBLISHED_PARAMS = {  # the models' cards / safetensors totals (Gemma 3 4B+: text decoder)
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800, "mistral-7b-v0.1": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
    "gemma-3-1b": 999_885_952, "smollm2-135m": 134_515_008, "smollm2-1.7b": 1_711_376_384,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_are_the_published_ones(name: str) -> None:
    assert BUILTIN[name].params == PUBLISHED_PARAMS[name]


def kv_fp16(name: str) -> int:
    s = BUILTIN[name]
    return 2 * s.layers * s.kv_heads * kv_bytes_per_token_head("fp16", s.head_dim)


def test_literature_kv_and_weight_figures() -> None:
    assert kv_fp16("llama-3-8b") == 32 * 8 * 128 * 2 * 2 == 131_072
    assert kv_fp16("llama-2-7b") == 32 * 32 * 128 * 2 * 2 == 524_288  # no GQA
    assert kv_fp16("llama-3-70b") == 80 * 8 * 128 * 2 * 2 == 327_680
    assert round(BUILTIN["llama-3-70b"].params * 2 / 1e9) == 141  # bf16 weights, GB
    # Gemma 3: head_dim 256 is not hidden / heads (1152 / 4 = 288)
    assert BUILTIN["gemma-3-1b"].head_dim == 256 != 1152 // 4


@pytest.mark.parametrize("spelling, key", [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"), ("Llama-2-7b-hf", "llama-2-7b"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"), ("google/gemma-3-4b-it", "gemma-3-4b"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"), ("Mistral-7B", "mistral-7b-v0.1"),
])
def test_builtin_names_accept_hub_spellings(spelling: str, key: str) -> None:
    assert builtin_key(spelling) == key
    assert resolve_model(spelling).shape is BUILTIN[key]


def test_unknown_model_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="unknown model 'llama-9b'") as e:
        resolve_model("llama-9b")
    assert "\n" not in str(e.value)


def test_hf_directory_with_a_multimodal_text_config(tmp_path) -> None:
    """Gemma 3 4B's config.json nests the decoder in text_config; its head_dim is not H / h."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
            "sliding_window": 1024}
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "text_config": text, "vision_config": {"hidden_size": 1152}}))
    shape = resolve_model(str(tmp_path)).shape
    builtin = BUILTIN["gemma-3-4b"]
    assert (shape.layers, shape.head_dim, shape.kv_heads, shape.vocab) == (34, 256, 4, 262208)
    assert shape.params == builtin.params  # tied (Gemma's default), q/k norms, sandwich norms


def test_hf_directory_errors_are_one_line(tmp_path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        resolve_model(str(tmp_path))


def test_embedded_gguf_shape_and_exact_weight_bytes(gguf_path) -> None:
    from memwall.loader.gguf_file import GGUFFile
    from memwall.loader.gguf_loader import gguf_hf_config

    model = resolve_model(None)
    assert model.source == f"gguf:{gguf_path}"
    reader = GGUFFile(gguf_path)
    assert model.gguf.total_bytes == sum(t.n_bytes for t in reader.tensors)
    assert model.gguf.types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    engine = gguf_hf_config(reader)  # the engine's reading of the same metadata
    s = model.shape
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
            s.tied_embeddings) == (
        engine["num_hidden_layers"], engine["hidden_size"], engine["num_attention_heads"],
        engine["num_key_value_heads"], engine["head_dim"], engine["intermediate_size"],
        engine["vocab_size"], engine["tie_word_embeddings"])
    assert s.params == BUILTIN["smollm2-135m"].params


def test_a_file_that_is_not_gguf_is_a_one_line_error(tmp_path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read .* as a GGUF file"):
        from_gguf(bad)
