"""One reader per GGUF file, shared by the tokenizer and the weight loader: the metadata parsed once per
process, the tensors memory-mapped and read on access.

The layout is GGUF's (v2 and v3, little-endian): a header (magic, version, tensor count, metadata count), the
metadata as (key, type, value) records, one record per tensor (name, dims innermost first, GGML type, offset),
then the tensors' data from the next multiple of `general.alignment`. It is parsed here rather than with
gguf-py's `GGUFReader`, which builds a memory-mapped view for every part of every value (every string of a
vocabulary and its merges) in every process that loads a tokenizer; gguf-py still names the GGML types and
their block sizes, and dequantises (docs/worker.md, "Loading a GGUF file").
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_REQUIRED = object()
_MAGIC = 0x46554747  # b"GGUF", little-endian
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, numpy dtype) of the fixed-size ones
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types gguf-py reads as numbers; every other type is read as its bytes, as gguf-py does, for dequantize.
_NUMERIC = {
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: innermost first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # numbers in the outermost-first shape, or each row's bytes for a block-quantised type


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> str, number, bool or list) and its tensors, in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = str(path)
        self._offset = 0
        if self._scalar("<I") != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version not in _VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} (as little-endian) is not supported (2, 3)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        records = [self._tensor_record() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *record) for record in records]

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._scalar("<Q")
        text = self._map[self._offset : self._offset + size].decode("utf-8")
        self._offset += size
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
                items = np.frombuffer(self._map, dtype, count, self._offset)
                self._offset += items.nbytes
                return items.tolist()
            return [self._value(item_kind) for _ in range(count)]
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind][0])
        raise ValueError(f"{self.path}: unknown GGUF metadata type {kind} at byte {self._offset}")

    def _tensor_record(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(raw_type)
        outer_first = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        if tensor_type in _NUMERIC:
            data = np.frombuffer(self._map, _NUMERIC[tensor_type], count, start + offset).reshape(outer_first)
        else:
            block, size = gguf.GGML_QUANT_SIZES[tensor_type]
            data = np.frombuffer(self._map, np.uint8, count * size // block, start + offset)
            data = data.reshape(gguf.quant_shape_to_byte_shape(outer_first, tensor_type))
        return GGUFTensor(name, dims, tensor_type, data)


def read_gguf(path: str | Path) -> GGUFFile:
    """The file, parsed once per process."""
    return _read_gguf(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value; `default` when absent, or ValueError naming the key when no default is given."""
    if key not in reader.fields:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return reader.fields[key]
