"""The lean GGUF reader (memwall/loader/gguf_file.py) reads what gguf.GGUFReader reads: every
metadata value as the code that consumes them decodes it, and every tensor's bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from memwall.loader.errors import ModelLoadError
from memwall.loader.gguf_file import GGUFFile
from memwall.loader.gguf_loader import open_gguf
from memwall.tokenizer.gguf_tokenizer import _field


def assert_same(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key in ours.fields:
        assert ours.fields[key].types == ref.fields[key].types, key
        assert _field(ours, key) == _field(ref, key), key
        assert len(ours.fields[key].data) == len(ref.fields[key].data), key
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == \
               (b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert a.data.flags.writeable  # a fresh array, not a view of a mapping


def test_embedded_model_reads_as_gguf_reader_does(gguf_path):
    assert_same(gguf_path)


def test_every_metadata_type(tmp_path):
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "caf\u00e9 \U0001f680")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "\u65e5\u672c"])
    w.add_array("t.empty", [])
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.arange(6, dtype=np.float16))
    q = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same(path)
    f = GGUFFile(path)
    assert _field(f, "t.strs") == ["a", "", "\u65e5\u672c"] and _field(f, "t.u64") == 2**40
    assert f.tensors[2].data.shape == (2, 34)  # Q8_0: rows of 34-byte blocks, as GGUFReader


def test_absurd_array_length_is_a_load_error(tmp_path):
    path = tmp_path / "big.gguf"
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    key = b"k"
    entry = len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little")  # ARRAY
    entry += (8).to_bytes(4, "little") + (2**60).to_bytes(8, "little")  # of 2**60 strings
    path.write_bytes(header + entry + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        open_gguf(path)
