"""`kvroute` command line, the top of the import graph: each subcommand lives beside the code it drives and is
imported only when used. `python -m launch.cli ARGS` is the console script `kvroute ARGS`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvroute.errors import UserError

# gRPC's C core logs connection events (a worker's GOAWAY at shutdown) at INFO on stderr, where they read as
# errors; an operator who wants them sets GRPC_VERBOSITY. It must be set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# The modules of pyproject.toml's `worker` extra: a subcommand that needs one says so (_without_worker_extra).
WORKER_EXTRA_MODULES = frozenset({"torch", "triton", "safetensors", "matplotlib", "ninja", "tqdm", "xgrammar"})

# name -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "replay": ("sim.replay_cli", "replay a trace through simulated replicas and compare routing policies"),
    "doctor": ("sim.doctor", "find where each app's prompts stop sharing their prefix, and what it costs"),
    "generate": ("worker.cli_generate", "generate text offline with the worker engine"),
    "worker": ("launch.worker", "run a worker: the engine behind its gRPC service (and, with --http-port, HTTP)"),
    "gateway": ("gateway.cli_gateway", "run a gateway: OpenAI HTTP and gRPC front doors routing over a fleet"),
    "epp": ("gateway.cli_epp", "run an endpoint picker: Envoy ext_proc for a Gateway API InferencePool"),
    "up": ("launch.up", "run a local fleet: N workers and a gateway, stopped together with Ctrl-C"),
    "quality": (
        "quality.cli",
        "judge a candidate engine configuration (weights, KV cache dtype, ...) against a reference, by a rule",
    ),
    "bench": ("loadtest.bench_cli", "send a workload to a live fleet (or compare routers) and report latencies"),
    "sweep": ("sim.sweep", "capacity planning: replay a trace over a grid of fleet and cache sizes"),
    "export-tokenizer": (
        "kvroute.export_tokenizer",
        "write a model's tokenizer as an HF folder (tokenizer.json, tokenizer_config.json) for other tools",
    ),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="prefix-aware LLM serving fleet")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported: `kvroute replay` never loads torch.
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
    except ModuleNotFoundError as exc:
        return _without_worker_extra(exc, argv)
    try:
        return args.run(args)
    except UserError as exc:
        print(f"kvroute {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _without_worker_extra(exc, argv)
    except KeyboardInterrupt:
        return 130


def _without_worker_extra(exc: ModuleNotFoundError, argv: list[str]) -> int:
    """A subcommand that runs the engine, on an install without the `worker` extra (`pip install .`, a gateway
    host's): one line saying what to install, not a traceback. Any other missing module is raised."""
    missing = (exc.name or "").split(".")[0]
    if missing not in WORKER_EXTRA_MODULES:
        raise exc
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    print(
        f"kvroute {command}: error: needs {missing}, which the `worker` extra brings: pip install '.[worker]' in "
        "kvroute's source tree (without a GPU, torch's CPU build first: README, 'Installing without make')",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
