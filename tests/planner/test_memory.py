"""Will it fit: weights per rank, activations, the 20% reserve and requests at full context."""

from __future__ import annotations

from memwall.planner import plan_json
from memwall.planner.memory import model_weights
from memwall.planner.shapes import BUILTIN
from memwall.planner.sources import ModelSource, resolve_model

LLAMA3_8B_BF16 = 8_030_261_248 * 2


def test_llama3_8b_on_one_80gb_gpu_at_4k() -> None:
    """Assumptions: an 80 GB GPU counted as 80e9 bytes, 20% held back, bf16 weights and KV,
    every request at 4096 tokens, a 2048-token step (activations) and 256 sampled rows."""
    doc = plan_json({"model": "llama-3-8b", "gpu": "H100", "max_model_len": 4096})
    mem = doc["memory"]
    usable = 80e9 * 0.8
    hidden = 2048 * 2 * (2 * 4096 + 3 * 14336)       # tokens x bf16 x live values (MLP)
    logits = 256 * 128256 * 4 * 2                    # float32 logits and probabilities
    per_request = 131_072 * 4096
    assert mem["weights_per_rank_bytes"] == LLAMA3_8B_BF16
    assert mem["activations_bytes"] == hidden + logits == 472_383_488
    assert mem["kv_bytes_per_request"] == per_request
    assert mem["max_concurrent_requests"] == int((usable - LLAMA3_8B_BF16 - hidden - logits)
                                                 // per_request) == 88
    # the published-style figure, activations ignored: (80e9 x 0.8 - 16.06e9) / (131072 x 4096)
    assert round((usable - 16.06e9) / per_request) == 89
    assert abs(mem["max_concurrent_requests"] - 89) <= 1


def test_reserve_is_configurable_and_gpus_add_replicas() -> None:
    base = plan_json({"model": "llama-3-8b", "gpu": "H100", "max_model_len": 4096, "reserve": 0.1})
    assert base["memory"]["usable_bytes"] == 72e9
    two = plan_json({"model": "llama-3-8b", "gpu": "H100x2", "max_model_len": 4096})
    assert two["parallel"]["replicas"] == 2 and two["memory"]["max_concurrent_requests"] == 176


def test_gguf_weights_are_the_files_and_quantization_changes_the_layers(gguf_path) -> None:
    model = resolve_model(None)
    auto = model_weights(model, "fp32", "auto")
    assert auto.total_bytes == model.gguf.total_bytes
    shape = BUILTIN["smollm2-135m"]
    assert model_weights(model, "fp32", "none").total_bytes == shape.params * 4
    q4 = model_weights(ModelSource(shape, "builtin"), "bf16", "q4_k")
    assert q4.total_bytes == round(shape.layers * (shape.layer_matrix_params() * 4.5 / 8
                                                   + shape.layer_vector_params() * 2)) \
        + shape.embedding_params() * 2 + shape.hidden * 2


def test_pipeline_stages_hold_their_layers_and_the_vocabulary_ends() -> None:
    doc = plan_json({"model": "llama-3-70b", "gpu": "H100x8", "tensor_parallel_size": 4,
                     "pipeline_parallel_size": 2, "max_model_len": 2048, "batch": 64})
    first, last = doc["memory"]["stages"]
    s = BUILTIN["llama-3-70b"]
    layer, vocab = s.layer_params() * 2 / 4, s.vocab * s.hidden * 2 / 4
    assert first["layers"] == [0, 41] and last["layers"] == [41, 80]  # the engine's split
    assert first["weights_bytes"] == round(41 * layer + vocab)
    assert last["weights_bytes"] == round(39 * layer + vocab + s.hidden * 2 / 4)
    assert first["kv_bytes_per_token"] == 41 * 2 * 2 * 128 * 2
    assert last["activations_bytes"] > first["activations_bytes"]  # the logits


def test_a_model_that_does_not_fit_says_so() -> None:
    doc = plan_json({"model": "llama-3.1-405b", "gpu": "H100"})
    assert not doc["memory"]["fits"] and doc["memory"]["max_concurrent_requests"] == 0
    assert any(n.startswith("does not fit") for n in doc["notes"])
