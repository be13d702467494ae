"""One reader per GGUF file, shared by the tokenizer and the weight loader (parsing SmolLM2's takes ~2 s)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf

_REQUIRED = object()


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    """The file's reader (memory-mapped; tensors are read on access), parsed once per process."""
    return _read_gguf(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value; `default` when absent, or ValueError naming the key when no default is given."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()
