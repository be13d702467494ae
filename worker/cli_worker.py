"""`kvroute worker`: load a model and serve it over gRPC (proto/worker.proto) until SIGINT / SIGTERM.

Exit codes:
  0    a signal: the worker drained (health NOT_SERVING, new requests UNAVAILABLE, running ones get
       `--drain-timeout` seconds to finish) and stopped;
  130  a second signal during the drain: it stops at once;
  1    the engine died: health turned NOT_SERVING at once, and the process exits `--engine-dead-grace`
       seconds later (so gateways see the state before the address goes away), for Kubernetes to restart it;
  2    bad arguments, printed as one line.
SIGHUP, once serving, is ignored with a line on stderr (the worker has nothing to reload; a terminal that
closes does not stop it).

Parts that run beside the server in the same process (a reporter, an HTTP front door) add their flags in
`add_arguments` and start in `serve`, next to `start_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvkernels.weight_only import GROUP_SIZES
from kvroute.errors import UserError
from kvroute.heap import freeze_start_up_heap
from kvroute.model_source import resolve_model
from worker.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    WEIGHT_SCHEMES,
    WEIGHTS,
    EngineConfig,
)

if TYPE_CHECKING:
    from worker.engine import LLMEngine
    from worker.service import WorkerServer

logger = logging.getLogger("kvroute.worker")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | sim | a .gguf file | an HF directory")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC listen address (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    parser.add_argument("--metrics-host", default=None, help="metrics listen address (default: --host)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype)
    add_weight_arguments(parser)
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=defaults.attention_backend)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: from --kv-cache-memory-gb")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=defaults.kv_cache_memory_gb)
    parser.add_argument(
        "--host-kv-blocks",
        type=int,
        default=defaults.host_kv_blocks,
        help="a host-memory tier of this many KV blocks behind the device pool: evicted cached blocks go there "
        "and come back by copy instead of prefill (default 0: none)",
    )
    parser.add_argument(
        "--host-kv-memory-gb", type=float, default=defaults.host_kv_memory_gb, help="the host tier's size in GiB"
    )
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens, help="prefill chunk budget"
    )
    parser.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=defaults.decode_reserve_tokens,
        help="admit a request only while the KV blocks stay free that every running request needs to finish its "
        "prompt and decode up to this many more tokens (its max_tokens if fewer), so a burst waits in the queue "
        "instead of preempting; 0: keep only the watermark free (default: %(default)s)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=defaults.scheduling_policy,
        help="vLLM's: fcfs admits waiting requests in arrival order; priority by (priority, arrival), a more urgent "
        "request preempting less urgent running ones when it does not fit (default: %(default)s)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on exit")
    parser.add_argument(
        "--worker-id",
        default=os.environ.get("KVROUTE_WORKER_ID") or None,
        help="stable identity (default: $KVROUTE_WORKER_ID, else <hostname>-<port>)",
    )
    parser.add_argument(
        "--advertise-address",
        default=None,
        help="host:port gateways dial (default: --host:port, a wildcard host replaced by this host's name)",
    )
    parser.add_argument(
        "--max-concurrent-streams", type=int, default=256, help="open Generate streams; past it RESOURCE_EXHAUSTED"
    )
    parser.add_argument(
        "--max-waiting", type=int, default=256, help="requests waiting for a slot; past it RESOURCE_EXHAUSTED"
    )
    parser.add_argument(
        "--engine-dead-grace",
        type=float,
        default=10.0,
        help="seconds between the engine's death (NOT_SERVING at once) and the process's exit with status 1",
    )
    parser.add_argument(
        "--redis", default=None, help="report to Redis fleet state (redis://, rediss://, redis+sentinel://)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between Redis heartbeats")
    parser.add_argument("--heartbeat-ttl", type=float, default=5.0, help="seconds a heartbeat stays valid in Redis")
    parser.add_argument(
        "--auth-token-file",
        default=None,
        help="serve only calls presenting the token in this file (default: $KVROUTE_WORKER_TOKEN_FILE, "
        "else $KVROUTE_WORKER_TOKEN; none: anyone who reaches the port)",
    )
    parser.add_argument(
        "--kv-snapshot-rate", type=float, default=2.0, help="whole-pool KV snapshot reads per second (GetKVEvents)"
    )
    parser.add_argument("--kv-snapshot-burst", type=float, default=8.0, help="KV snapshot reads at once, >= 1")
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="publish KV events as vLLM does, vLLM's JSON: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv@IP:PORT@MODEL"}\'. As in vLLM, the endpoint is bound '
        "only with a wildcard host (tcp://*:PORT) or an ipc/inproc address; one spelled tcp://HOST:PORT "
        'CONNECTS to a subscriber that binds it (llm-d\'s layout), unless "bind": true',
    )
    parser.add_argument(
        "--sim-prefill-us-per-token", type=float, default=defaults.sim_prefill_us_per_token, help="--model sim only"
    )
    parser.add_argument(
        "--sim-decode-ms-per-step", type=float, default=defaults.sim_decode_ms_per_step, help="--model sim only"
    )
    parser.add_argument(
        "--sim-host-copy-us-per-block",
        type=float,
        default=defaults.sim_host_copy_us_per_block,
        help="--model sim only: a block's copy to or from the host tier",
    )


def add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    """`--weights`, `--weight-group-size`, `--weight-scheme` (`kvroute worker` and `kvroute generate`)."""
    defaults = EngineConfig()
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=defaults.weights,
        help="linear layers and embedding: float (the model's dtype; auto is float) or weight-only int8 / int4 "
        "(a GGUF's Q8_0 / Q4_0 / Q4_1 blocks as they are, float weights quantized per group)",
    )
    parser.add_argument(
        "--weight-group-size",
        type=int,
        choices=GROUP_SIZES,
        default=defaults.weight_group_size,
        help="inputs per scale when quantizing (default: a GGUF's own 32-input blocks, else the largest of "
        "128/64/32 dividing every layer)",
    )
    parser.add_argument(
        "--weight-scheme",
        choices=WEIGHT_SCHEMES,
        default=defaults.weight_scheme,
        help="sym (scales only) or asym (scales and minimums) when quantizing float weights",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        weights=args.weights,
        weight_group_size=args.weight_group_size,
        weight_scheme=args.weight_scheme,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        host_kv_blocks=args.host_kv_blocks,
        host_kv_memory_gb=args.host_kv_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_reserve_tokens=args.decode_reserve_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        device=args.device,
        seed=args.seed,
        sim_prefill_us_per_token=args.sim_prefill_us_per_token,
        sim_decode_ms_per_step=args.sim_decode_ms_per_step,
        sim_host_copy_us_per_block=args.sim_host_copy_us_per_block,
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(build_engine(args), args))


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine the flags describe (UserError on a bad flag); launch.worker reuses it."""
    from worker.engine import LLMEngine

    kv_events_config(args)
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 <= port < 65536:
            raise UserError(f"{flag} must be in [0, 65536), got {port}")
    for flag, count in (("--max-concurrent-streams", args.max_concurrent_streams), ("--max-waiting", args.max_waiting)):
        if count < 1:
            raise UserError(f"{flag} must be >= 1, got {count}")
    for flag, seconds in (("--drain-timeout", args.drain_timeout), ("--engine-dead-grace", args.engine_dead_grace)):
        if not seconds >= 0:
            raise UserError(f"{flag} must be >= 0 seconds, got {seconds}")
    if not args.kv_snapshot_rate > 0:
        raise UserError(f"--kv-snapshot-rate must be > 0 reads per second, got {args.kv_snapshot_rate}")
    if not args.kv_snapshot_burst >= 1:
        raise UserError(f"--kv-snapshot-burst must be >= 1, got {args.kv_snapshot_burst}")
    auth_token(args)  # a bad token file is an error now, not after the model has loaded
    check_device(args.device)
    try:
        if args.model != "sim":
            resolve_model(args.model)  # a model that is not there is a one-line error, before any progress line
            print(f"kvroute worker: loading the model {args.model}", file=sys.stderr, flush=True)
        return LLMEngine(engine_config(args))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc


def kv_events_config(args: argparse.Namespace):
    """`--kv-events-config` parsed (worker.kv_event_publisher.KVEventsConfig), None when absent or not
    publishing; UserError for JSON vLLM would not take."""
    if not getattr(args, "kv_events_config", None):
        return None
    from worker.kv_event_publisher import KVEventsConfig

    try:
        config = KVEventsConfig.from_json(args.kv_events_config)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return config if config.publishes else None


def check_device(spec: str) -> None:
    """Raise UserError unless `spec` names a device the worker runs on (cpu, cuda, cuda:N) and, for CUDA,
    one this machine has."""
    import torch

    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"--device {spec!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise UserError(f"--device {spec!r}: the worker runs on cpu or cuda[:N]")
    count = torch.cuda.device_count()
    if count == 0:
        raise UserError(f"--device {spec!r}: torch sees no CUDA device on this machine")
    if device.index is not None and device.index >= count:
        raise UserError(f"--device {spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


async def start_server(engine: LLMEngine, args: argparse.Namespace) -> WorkerServer:
    """The gRPC server as the flags say; UserError when it cannot listen or a flag is bad."""
    from worker.service import start_worker_server

    token = auth_token(args)
    if token is None and args.host not in LOOPBACK_HOSTS:
        logger.warning(
            "no worker token (--auth-token-file, $KVROUTE_WORKER_TOKEN_FILE): anyone who reaches %s:%d can "
            "generate and read this worker's cache",
            args.host,
            args.port,
        )
    try:
        return await start_worker_server(
            engine,
            args.host,
            args.port,
            args.metrics_port,
            args.metrics_host,
            worker_id=args.worker_id,
            advertise_address=args.advertise_address,
            max_concurrent_streams=args.max_concurrent_streams,
            max_waiting=args.max_waiting,
            auth_token=token,
            kv_snapshot_rate=args.kv_snapshot_rate,
            kv_snapshot_burst=args.kv_snapshot_burst,
        )
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from exc


def auth_token(args: argparse.Namespace) -> str | None:
    """The worker token the flags and environment name (kvroute.credentials), or None; UserError if unreadable.
    launch.worker's HTTP front door presents the same token to this worker."""
    from kvroute.credentials import worker_token

    try:
        return worker_token(args.auth_token_file, "--auth-token-file")
    except ValueError as exc:
        raise UserError(str(exc)) from exc


async def serve(
    engine: LLMEngine, args: argparse.Namespace, on_serving: Callable[[WorkerServer], None] | None = None
) -> int:
    """Serve until a signal (drain: 0), a second signal during the drain (130) or the engine's death (1).
    `on_serving` is called with the server once it listens (launch.worker's front door serves its metrics).
    Spans are exported over OTLP when the standard OTEL_EXPORTER_OTLP_ENDPOINT variables are set."""
    from kvroute.tracing import flush_tracing, setup_tracing

    setup_tracing("kvroute-worker")
    try:
        return await _serve(engine, args, on_serving)
    finally:
        flush_tracing()


def weights_note(engine: LLMEngine) -> str:
    """ "; weights int4 g32 x 120, ... on <backend>" for a weight-only quantized model, else ""."""
    from worker.model_runner import ModelRunner

    if isinstance(engine.runner, ModelRunner) and engine.runner.weights != "float":
        return f"; weights {engine.runner.weights}"
    return ""


async def _serve(engine: LLMEngine, args: argparse.Namespace, on_serving: Callable[[WorkerServer], None] | None) -> int:
    server = await start_server(engine, args)
    if on_serving is not None:
        on_serving(server)
    metrics = ""
    if server.metrics.address is not None:
        metrics = f", metrics on {server.metrics.address[0]}:{server.metrics.address[1]}/metrics"
    print(
        f"kvroute worker: serving {engine.model_id} on {args.host}:{server.port} as {server.worker_id} "
        f"(advertised {server.advertise_address}, incarnation {server.incarnation:016x}){metrics}",
        flush=True,
    )
    print(
        f"kvroute worker: dtype {engine.dtype_reason}; attention {engine.attention_backend}{weights_note(engine)}",
        file=sys.stderr,
    )
    publisher = None
    events_config = kv_events_config(args)
    if events_config is not None:
        from worker.kv_event_publisher import KVEventPublisher

        publisher = KVEventPublisher(server.engine, events_config, engine.config.block_size)
        try:
            publisher.start()
        except ValueError as exc:
            await server.stop(drain_timeout=0)
            raise UserError(str(exc)) from exc
        replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        attached = "on" if publisher.binds else "connected to (waiting for a subscriber to bind)"
        print(f"kvroute worker: KV events {attached} {publisher.endpoint}{replay}", flush=True)
    reporter = None
    if args.redis:
        from kvroute.credentials import redis_password
        from worker.reporter import start_reporter

        try:
            reporter = await start_reporter(
                server,
                args.redis,
                heartbeat_interval=args.heartbeat_interval,
                heartbeat_ttl=args.heartbeat_ttl,
                password=redis_password(),
            )
        except ValueError as exc:
            await server.stop(drain_timeout=0)
            raise UserError(str(exc)) from exc
    freeze_start_up_heap()
    try:
        return await run_until_exit(server, args)
    finally:
        if reporter is not None:
            await reporter.stop()
        if publisher is not None:
            publisher.stop()


async def run_until_exit(server: WorkerServer, args: argparse.Namespace) -> int:
    """Wait for a signal or the engine's death, stop the server as the exit codes above say, and return the
    code. The server is stopped (or, after a second signal, no longer listening) when this returns."""
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    loop.add_signal_handler(signal.SIGHUP, _ignore_hangup)
    engine_dead = asyncio.ensure_future(server.engine.wait_dead())
    first_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait({engine_dead, first_signal}, return_when=asyncio.FIRST_COMPLETED)
    if engine_dead.done():
        first_signal.cancel()
        print(
            f"kvroute worker: the engine died ({engine_dead.result()}); health is NOT_SERVING, "
            f"exiting with status 1 in {args.engine_dead_grace:g} s",
            file=sys.stderr,
            flush=True,
        )
        try:  # a signal ends the grace early
            await asyncio.wait_for(signals.get(), args.engine_dead_grace)
        except TimeoutError:
            pass
        await server.stop(drain_timeout=0)
        return 1
    engine_dead.cancel()
    print(f"kvroute worker: draining (up to {args.drain_timeout:g} s; a second signal stops at once)", flush=True)
    drain = asyncio.ensure_future(server.stop(args.drain_timeout))
    second_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait({drain, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    if drain.done():
        second_signal.cancel()
        drain.result()
        return 0
    drain.cancel()
    print("kvroute worker: second signal; stopping without draining", file=sys.stderr, flush=True)
    await server.server.stop(grace=None)
    return 130


def _ignore_hangup() -> None:
    print("kvroute worker: SIGHUP ignored (nothing to reload; SIGTERM drains)", file=sys.stderr, flush=True)
