"""`kvroute worker`: load a model and serve it over gRPC (proto/worker.proto) until SIGINT / SIGTERM.

On a signal the worker drains: health turns NOT_SERVING, new requests get UNAVAILABLE, running ones get
`--drain-timeout` seconds to finish, then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import TYPE_CHECKING

from kvroute.cli import UserError
from worker.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, EngineConfig

if TYPE_CHECKING:
    from worker.engine import LLMEngine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | sim | a .gguf file | an HF directory")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC listen address (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype)
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: from --kv-cache-memory-gb")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=defaults.kv_cache_memory_gb)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens, help="prefill chunk budget"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on exit")
    parser.add_argument(
        "--sim-prefill-us-per-token", type=float, default=defaults.sim_prefill_us_per_token, help="--model sim only"
    )
    parser.add_argument(
        "--sim-decode-ms-per-step", type=float, default=defaults.sim_decode_ms_per_step, help="--model sim only"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        device=args.device,
        seed=args.seed,
        sim_prefill_us_per_token=args.sim_prefill_us_per_token,
        sim_decode_ms_per_step=args.sim_decode_ms_per_step,
    )


def run(args: argparse.Namespace) -> int:
    from worker.engine import LLMEngine

    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65536), got {args.port}")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise UserError(f"--metrics-port must be in [0, 65536), got {args.metrics_port}")
    try:
        engine = LLMEngine(engine_config(args))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    asyncio.run(serve(engine, args))
    return 0


async def serve(engine: LLMEngine, args: argparse.Namespace) -> None:
    from worker.service import start_worker_server

    try:
        server = await start_worker_server(engine, args.host, args.port, args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise UserError(str(exc)) from exc
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port is not None else ""
    print(f"kvroute worker: serving {engine.model_id} on {args.host}:{server.port}{metrics}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(f"kvroute worker: draining (up to {args.drain_timeout:g} s)", flush=True)
    await server.stop(args.drain_timeout)
