"""Regenerate the Python code of every proto/*.proto with grpc_tools.protoc (`python proto/generate.py`).

Protos are compiled from the repository root as `proto/<name>.proto`, so the generated modules import
each other as `from proto import worker_pb2` and register unique file names (`proto/worker.proto`) in
protobuf's global descriptor pool. tests/test_proto_sync.py regenerates into a temporary directory and
checks that the committed files are identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def generate(out_root: Path, source_root: Path = REPO_ROOT) -> list[Path]:
    """Compile `source_root/proto/*.proto` into `out_root/proto/`; returns the generated files."""
    from grpc_tools import protoc  # a build tool, not a runtime dependency

    sources = [path.relative_to(source_root).as_posix() for path in proto_files(source_root / "proto")]
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{source_root}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    stems = [Path(source).stem for source in sources]
    suffixes = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    return [out_root / "proto" / f"{stem}{suffix}" for stem in stems for suffix in suffixes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
