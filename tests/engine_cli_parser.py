"""The engines' own command-line parsers, run in a subprocess of their own (tests/test_engine_cli_parsers.py):

    python tests/engine_cli_parser.py ENGINE     (one JSON list of argv lists on stdin)

ENGINE `sglang`: `sglang.srt.server_args.ServerArgs.add_cli_args` (what `python -m sglang.launch_server` parses
with) from a `--no-deps` install of the sglang wheel, and its `KVEventsConfig.from_cli` on `--kv-events-config`
(what the server does with that flag's JSON). ENGINE `vllm`: `vllm serve`'s parser (`make_arg_parser` of
`vllm.entrypoints.common.cli_args`, `vllm.entrypoints.openai.cli_args` before vLLM 0.33) and
`EngineArgs.from_cli_args`, from a vllm package on PYTHONPATH. Prints, per argv, the parsed values the gateway
depends on as one JSON line, or `{"error": ...}` for an argv the parser refuses. Exits 3, printing the import
error, when the engine's parser does not import.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | dict:
    """The parsed flags, or `{"error": the parser's last line}` for an argv it refuses."""
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            return parser.parse_args(argv)
    except SystemExit:
        return {"error": err.getvalue().strip().splitlines()[-1]}


def parse_sglang(argvs: list[list[str]]) -> list[dict]:
    from sglang.srt.disaggregation.kv_events import KVEventsConfig
    from sglang.srt.server_args import ServerArgs

    out = []
    for argv in argvs:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = _parse(parser, argv)
        if isinstance(args, dict):
            out.append(args)
            continue
        events = KVEventsConfig.from_cli(args.kv_events_config).model_dump() if args.kv_events_config else None
        out.append({
            "page_size": args.page_size, "port": args.port, "enable_metrics": args.enable_metrics,
            "served_model_name": args.served_model_name, "model": args.model_path, "kv_events": events,
        })  # fmt: skip
    return out


def parse_vllm(argvs: list[list[str]]) -> list[dict]:
    # vLLM picks a platform as its config imports; this machine has no GPU and the package no compiled build
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.33 moved `vllm serve`'s parser out of the OpenAI entrypoint
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    out = []
    for argv in argvs:
        parser = make_arg_parser(FlexibleArgumentParser())
        args = _parse(parser, argv)
        if isinstance(args, dict):
            out.append(args)
            continue
        engine = EngineArgs.from_cli_args(args)
        events = engine.kv_events_config
        out.append({
            "block_size": engine.block_size, "port": args.port, "model": engine.model,
            "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
            "kv_events": None if events is None else {
                k: getattr(events, k) for k in ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                                                "topic")
            },
        })  # fmt: skip
    return out


def main() -> int:
    engine = sys.argv[1]
    argvs = json.loads(sys.stdin.read())
    try:
        results = parse_sglang(argvs) if engine == "sglang" else parse_vllm(argvs)
    except ImportError as exc:
        print(f"{type(exc).__name__}: {exc}")
        return 3
    for result in results:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
