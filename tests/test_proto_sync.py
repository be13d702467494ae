"""The committed generated code in proto/ is exactly what proto/generate.py produces from the .proto files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from proto import generate  # noqa: E402


def test_generated_code_is_in_sync(tmp_path: Path) -> None:
    source_root = tmp_path / "src"
    (source_root / "proto").mkdir(parents=True)
    for proto in generate.proto_files():
        shutil.copy(proto, source_root / "proto" / proto.name)
    out_root = tmp_path / "out"
    generated = generate.generate(out_root, source_root=source_root)
    assert generated, "no .proto files found"
    for fresh in generated:
        committed = generate.PROTO_DIR / fresh.name
        assert committed.is_file(), f"{committed} is missing; run: python proto/generate.py"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed} is stale; run: python proto/generate.py"


def test_generated_modules_import_as_package() -> None:
    from proto import worker_pb2, worker_pb2_grpc

    assert worker_pb2.DESCRIPTOR.package == "kvroute.v1"
    assert hasattr(worker_pb2_grpc, "WorkerStub")
