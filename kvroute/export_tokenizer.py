"""`kvroute export-tokenizer`: write a model's tokenizer out as an HF tokenizer folder.

    kvroute export-tokenizer --model smollm2 --out ./smollm2-tokenizer

Load tools (guidellm, aiperf) and a stock engine's `--tokenizer` want the served model's tokenizer as an HF
folder, which for a GGUF model lives only inside the GGUF. This writes `tokenizer.json`,
`tokenizer_config.json` (chat template, bos / eos, added tokens, `model_max_length`) and
`special_tokens_map.json` from the same `kvroute.tokenizer.Tokenizer` the gateway and the workers use
(`Tokenizer.save_hf_dir` states what loads back the same).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvroute.errors import UserError
from kvroute.model_source import ModelSource, resolve_model, smollm2_gguf_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="smollm2, sim, tiny, a .gguf file or an HF directory")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write (created if missing)")
    parser.add_argument(
        "--model-max-length", type=int, default=None, help="model_max_length (default: the model's context length)"
    )
    parser.add_argument("--force", action="store_true", help="replace tokenizer files already in --out")


def run(args: argparse.Namespace) -> int:
    from kvroute.tokenizer import Tokenizer

    try:
        source = resolve_model(args.model)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    if args.model_max_length is not None and args.model_max_length < 1:
        raise UserError(f"--model-max-length must be >= 1, got {args.model_max_length}")
    present = [name for name in TOKENIZER_FILES if (args.out / name).exists()]
    if present and not args.force:
        raise UserError(f"{args.out} already holds {', '.join(present)}; pass --force to replace them")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is not a folder")
    tokenizer = Tokenizer.for_model(source)
    max_length = args.model_max_length or context_length(source)
    try:
        written = tokenizer.save_hf_dir(args.out, model_max_length=max_length)
    except OSError as exc:
        raise UserError(f"cannot write {args.out}: {exc}") from exc
    print(f"kvroute export-tokenizer: wrote {', '.join(str(path) for path in written)}")
    return 0


def context_length(source: ModelSource) -> int | None:
    """The model's context length from its own metadata (GGUF `<arch>.context_length`, HF config.json's
    `max_position_embeddings`); `sim` and `tiny` report SmolLM2's, whose tokenizer they use."""
    if source.kind == "hf":
        assert source.path is not None
        value = json.loads((source.path / "config.json").read_text()).get("max_position_embeddings")
        return int(value) if value else None
    from kvroute.gguf_file import gguf_field, read_gguf

    reader = read_gguf(source.path if source.kind == "gguf" and source.path is not None else smollm2_gguf_path())
    architecture = gguf_field(reader, "general.architecture", None)
    value = gguf_field(reader, f"{architecture}.context_length", None) if architecture else None
    return int(value) if value else None
