"""A lean GGUF reader: metadata parsed once into compact Python objects, tensor bytes read on
demand with ``read()`` (never mmapped).

Why not ``gguf.GGUFReader``: it builds two numpy views per array element, so a 49k-token
vocabulary plus its merges cost ~160 MB of Python objects (more than a small model's quantized
weights), and its tensors are views of an mmap, so every weight byte it hands over stays in the
process's resident set (as file pages) for as long as the reader lives. Here a string array is
one ``bytes`` blob plus offsets, and ``tensor.data`` is a fresh array read from the file: the
page cache holds the file, not us, and a tensor's bytes are freed once the caller drops them.

The objects keep GGUFReader's shape, for the code that reads them (gguf_loader.py,
memwall/tokenizer/gguf_tokenizer.py): ``fields[key]`` has ``types``, ``parts`` and ``data``
(``parts[data[i]]`` is element i: ``bytes`` for strings, a 1-element numpy array for numbers)
and ``tensors[i]`` has ``name``, ``tensor_type``, ``shape`` (GGUF ``ne``, fastest first),
``n_elements``, ``n_bytes``, ``data_offset`` and ``data`` (numpy, GGUFReader's dtype and shape).

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x   key (u64 len + bytes) | type u32 | value   (arrays: item type u32 | count u64 | items)
    n_tensors x   name | n_dims u32 | ne u64 x n_dims | type u32 | offset u64
    padding to general.alignment (32) | tensor data
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, GGUFValueType as VType

_SCALARS = {VType.UINT8: np.uint8, VType.INT8: np.int8, VType.UINT16: np.uint16,
            VType.INT16: np.int16, VType.UINT32: np.uint32, VType.INT32: np.int32,
            VType.FLOAT32: np.float32, VType.BOOL: np.bool_, VType.UINT64: np.uint64,
            VType.INT64: np.int64, VType.FLOAT64: np.float64}
_FLOAT_DTYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.F64: np.float64,
                 QType.I8: np.int8, QType.I16: np.int16, QType.I32: np.int32, QType.I64: np.int64}
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class _Strings(Sequence):
    """The elements of a string array: one blob and each element's (start, end)."""

    def __init__(self, blob: bytes, bounds: np.ndarray) -> None:
        self.blob, self.bounds = blob, bounds

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, i):
        start, end = self.bounds[i]
        return self.blob[start:end]

    def as_list(self) -> list[str]:
        """Every element as text (UTF-8, bad bytes replaced), in one pass: a 152k-token
        vocabulary element by element through __getitem__ took ~1 s."""
        blob = self.blob
        return [bytes(blob[a:b]).decode("utf-8", errors="replace") for a, b in self.bounds.tolist()]


class _Numbers(Sequence):
    """The elements of a numeric array, each as a 1-element view (as GGUFReader gives them)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        i = range(len(self.values))[i]
        return self.values[i:i + 1]

    def as_list(self) -> list:
        """Every element as a Python number, in one pass (262k scores: ~1 s one by one)."""
        return self.values.tolist()


@dataclass
class Field:
    name: str
    types: list[VType]
    parts: Sequence[Any]
    data: Sequence[int]


@dataclass
class Tensor:
    name: str
    tensor_type: QType
    shape: np.ndarray  # ne, fastest-first (uint64)
    n_elements: int
    n_bytes: int
    data_offset: int
    path: Path

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes read from the file into a new, writable array: numpy order,
        typed for float/int types, uint8 rows of blocks for quantized ones."""
        out = np.empty(self.n_bytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_offset)
            got = f.readinto(memoryview(out))
        if got != self.n_bytes:
            raise ValueError(f"tensor {self.name!r}: read {got} of {self.n_bytes} bytes")
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        if self.tensor_type in _FLOAT_DTYPES:
            return out.view(_FLOAT_DTYPES[self.tensor_type]).reshape(dims)
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return out.reshape(*dims[:-1], dims[-1] // block * type_size)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last numpy axis: GGUF's ``ne[0]``, where blocks run)."""
        block, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return int(self.shape[0]) // block * type_size

    def read_rows(self, rows: np.ndarray, byte_range: tuple[int, int] | None = None) -> np.ndarray:
        """uint8 ``[len(rows), width]``: only rows ``rows`` (numpy order, a 2-D tensor) and, with
        ``byte_range``, only bytes [start, stop) of each: a tensor-parallel rank's slice read
        without the rest (runs of consecutive whole rows are one read each)."""
        width = self.row_bytes
        start, stop = byte_range if byte_range is not None else (0, width)
        if not 0 <= start < stop <= width:
            raise ValueError(f"tensor {self.name!r}: bytes {start}..{stop} of rows of {width}")
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), stop - start), dtype=np.uint8)
        whole = byte_range is None or (start, stop) == (0, width)
        with open(self.path, "rb", buffering=0) as f:
            i = 0
            while i < len(rows):
                run = 1  # consecutive rows of full width: one read
                while whole and i + run < len(rows) and rows[i + run] == rows[i] + run:
                    run += 1
                f.seek(self.data_offset + int(rows[i]) * width + start)
                view = memoryview(out[i:i + run].reshape(-1))
                if f.readinto(view) != len(view):
                    raise ValueError(f"tensor {self.name!r}: short read at row {rows[i]}")
                i += run
        return out


class GGUFFile:
    """``fields`` (key -> Field, in file order), ``tensors`` (in file order), ``alignment``,
    ``data_offset`` and ``byte_order`` ("I": little-endian; big-endian files raise)."""

    byte_order = "I"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            self._mm, self._pos = mm, 0
            try:
                self._parse()
            finally:
                del self._mm  # no view of the mapping may outlive it

    def _parse(self) -> None:
        if self._take(4) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I")
        if version & 0xFFFF == 0:
            self.byte_order = "S"
            raise ValueError("big-endian GGUF")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string().decode("utf-8")
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = self._value(key, VType(self._unpack("<I")))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self.fields.get("general.alignment")
        self.alignment = int(align.parts[0][0]) if align else DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"invalid alignment {self.alignment}")
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    # ---- primitives
    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._mm):
            raise ValueError(f"unexpected end of file at byte {self._pos} (needs {n} more)")
        out = self._mm[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> int:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> bytes:
        return self._take(self._unpack("<Q"))

    # ---- metadata
    def _value(self, key: str, kind: VType) -> Field:
        if kind == VType.STRING:
            return Field(key, [kind], [self._string()], [0])
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind]).newbyteorder("<")
            return Field(key, [kind], [np.frombuffer(self._take(dtype.itemsize), dtype).copy()], [0])
        if kind != VType.ARRAY:
            raise ValueError(f"metadata {key!r} has unknown type {kind}")
        item, count = VType(self._unpack("<I")), self._unpack("<Q")
        if count > len(self._mm) - self._pos:  # every element takes at least a byte
            raise ValueError(f"metadata {key!r}: {count} elements cannot fit in the file")
        if item == VType.STRING:
            parts = self._strings(count)
        elif item in _SCALARS:
            dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
            parts = _Numbers(np.frombuffer(self._take(count * dtype.itemsize), dtype).copy())
        else:  # arrays of arrays: rare; kept as a list of their flattened elements
            inner = [self._value(key, item) for _ in range(count)]
            parts = [p for field in inner for i in field.data for p in [field.parts[i]]]
            types = [VType.ARRAY, *(inner[0].types if inner else [item])]
            return Field(key, types, parts, range(len(parts)))
        return Field(key, [VType.ARRAY, item], parts, range(len(parts)))

    def _strings(self, count: int) -> _Strings:
        # one tight loop over the lengths (a vocabulary holds 50k-260k strings): unpack_from
        # reads in place, where _unpack's slice and bounds check per element cost ~3x
        mm, start, size, pos = self._mm, self._pos, len(self._mm), self._pos
        length = struct.Struct("<Q").unpack_from
        bounds = [0] * (2 * count)
        for i in range(count):
            if pos + 8 > size:
                raise ValueError("unexpected end of file in a string array")
            n = length(mm, pos)[0]
            pos += 8
            bounds[2 * i], bounds[2 * i + 1] = pos - start, pos - start + n
            pos += n
        if pos > size:
            raise ValueError("unexpected end of file in a string array")
        self._pos = pos
        return _Strings(mm[start:pos], np.array(bounds, dtype=np.int64).reshape(count, 2))

    # ---- tensors
    def _tensor_info(self) -> tuple[str, np.ndarray, QType, int]:
        name = self._string().decode("utf-8")
        n_dims = self._unpack("<I")
        ne = np.frombuffer(self._take(8 * n_dims), dtype="<u8").copy()
        return name, ne, QType(self._unpack("<I")), self._unpack("<Q")

    def _tensor(self, name: str, ne: np.ndarray, qtype: QType, offset: int) -> Tensor:
        n_elements = int(np.prod(ne, dtype=np.int64)) if len(ne) else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        return Tensor(name, qtype, ne, n_elements, n_elements * type_size // block,
                      self.data_offset + offset, self.path)
