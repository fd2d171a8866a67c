"""Bytes per value: the planner's tables against gguf's block sizes and the engine's own KV
cache sizing (memwall/worker/kv_cache.py), for every --kv-cache-dtype."""

from __future__ import annotations

import pytest

from memwall.planner.precision import (GGUF_BITS, KV_ELEMENT_BYTES, compute_dtype, kv_cache_dtype,
                                       kv_bytes_per_token_head, precision)
from memwall.planner.shapes import BUILTIN, ModelShape
from memwall.planner.sources import from_gguf


def test_gguf_bits_per_weight_are_ggmls_block_sizes() -> None:
    import gguf

    for name, bits in GGUF_BITS.items():
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert bits == type_size * 8 / block, name
    assert precision("q6_k").bits == 6.5625 and precision("IQ4_XS").bits == 4.25
    assert precision("bfloat16").bytes_per_value == 2 and precision("int4").bytes_per_value == 0.5


def test_unknown_names_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="unknown weight precision 'q9_k'"):
        precision("q9_k")
    with pytest.raises(ValueError, match="dtype must be auto, float32"):
        compute_dtype("int4", on_gpu=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype("int4", "bf16", on_gpu=True)


def _arch(shape: ModelShape):
    from memwall.config import ModelArchConfig

    return ModelArchConfig.from_hf_dict({
        "num_hidden_layers": shape.layers, "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab})


def _embedded_arch(path):
    from memwall.config import ModelArchConfig
    from memwall.loader.gguf_file import GGUFFile
    from memwall.loader.gguf_loader import gguf_hf_config

    return ModelArchConfig.from_hf_dict(gguf_hf_config(GGUFFile(path)))


@pytest.mark.parametrize("which", ["embedded", "llama-3-8b"])
def test_kv_bytes_per_token_equal_the_engines_for_every_kv_dtype(which, gguf_path) -> None:
    from memwall.attention.kv_quant import KV_DTYPES
    from memwall.worker.kv_cache import bytes_per_token

    if which == "embedded":
        shape, arch = from_gguf(gguf_path).shape, _embedded_arch(gguf_path)
    else:
        shape = BUILTIN["llama-3-8b"]
        arch = _arch(shape)
    assert set(KV_DTYPES) == set(KV_ELEMENT_BYTES)
    for name, dtype in KV_DTYPES.items():
        planner = 2 * shape.layers * shape.kv_heads * kv_bytes_per_token_head(name, shape.head_dim)
        assert planner == bytes_per_token(arch, dtype), name


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_auto_kv_dtype_resolves_as_the_engine_does(on_gpu: bool, dtype: str) -> None:
    from memwall.attention.kv_quant import name_of
    from memwall.config import DeviceConfig
    from memwall.worker.device import kv_cache_dtype as engine_kv_dtype

    engine = name_of(engine_kv_dtype(DeviceConfig("cuda" if on_gpu else "cpu", dtype)))
    assert kv_cache_dtype("auto", compute_dtype(dtype, on_gpu), on_gpu) == engine
