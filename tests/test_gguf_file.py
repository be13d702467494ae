"""kvroute's GGUF reader against gguf-py's `GGUFReader`, the format's reference implementation."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from kvroute.gguf_file import GGUFFile, gguf_field
from kvroute.model_source import smollm2_gguf_path


def test_smollm2s_file_reads_as_gguf_py_reads_it():
    path = smollm2_gguf_path()
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key] == reference.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.shape == tuple(theirs.shape.tolist()) and mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data), mine.name
    assert {t.tensor_type for t in ours.tensors} >= {gguf.GGMLQuantizationType.F32}  # and block-quantised ones


def test_a_file_gguf_py_wrote_reads_back(tmp_path):
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_float64("test.eps", 1e-6)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo\n")
    writer.add_array("test.ints", [-1, 2, 3])
    writer.add_array("test.words", ["a", "", "ß c"])
    writer.add_tensor("blk.0.w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("blk.0.h", np.ones((4, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = GGUFFile(path)
    assert gguf_field(read, "general.architecture") == "llama"
    scalars = [gguf_field(read, k) for k in ("test.count", "test.eps", "test.flag", "test.text")]
    assert scalars == [7, 1e-6, True, "héllo\n"]
    assert gguf_field(read, "test.ints") == [-1, 2, 3] and gguf_field(read, "test.words") == ["a", "", "ß c"]
    assert gguf_field(read, "test.absent", None) is None
    with pytest.raises(ValueError, match="no 'test.absent'"):
        gguf_field(read, "test.absent")
    w, h = read.tensors
    assert (w.name, w.shape) == ("blk.0.w", (3, 2)) and np.array_equal(w.data, np.arange(6).reshape(2, 3))
    assert h.data.dtype == np.float16 and h.data.shape == (4, 32)


def test_not_a_gguf_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(struct.pack("<II", 0x46554747, 9) + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 9"):
        GGUFFile(bad)
