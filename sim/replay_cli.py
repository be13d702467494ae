"""`kvroute replay TRACE`: compare routing policies on a trace (see sim.replay for the model)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gateway.flow_control.config import FlowControlConfig
from kvroute.errors import UserError
from kvroute.hashing import DEFAULT_BLOCK_SIZE
from kvroute.heap import freeze_start_up_heap
from sim.replay import (
    ORACLE,
    REPLAY_MODEL_ID,
    REPLAY_POLICIES,
    ReplayConfig,
    ReplayError,
    ReplayResult,
    replay,
)
from sim.traces import Trace, TraceError, read_mooncake
from sim.workloads import WORKLOAD_NAMES, WorkloadError, generate

SYNTHETIC = "synthetic:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help=f"Mooncake JSONL (optionally .gz) or {SYNTHETIC}NAME; NAME: {', '.join(WORKLOAD_NAMES)}",
    )
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument(
        "--policies",
        default="round_robin,prefix,kv_aware",
        help=f"comma list from: {', '.join(REPLAY_POLICIES)} (default round_robin,prefix,kv_aware; "
        f"the bounded {ORACLE} always runs: it is the yardstick)",
    )
    parser.add_argument("--capacity-blocks", type=int, default=10_000, help="KV blocks per replica (default 10000)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per block, synthetic traces only (default {DEFAULT_BLOCK_SIZE}; Mooncake: 512)",
    )
    parser.add_argument("--requests", type=int, default=None, help="requests to generate (synthetic traces)")
    parser.add_argument("--seed", type=int, default=0, help="generator and random-policy seed (default 0)")
    parser.add_argument("--gateways", type=int, default=1, help="gateways the requests are dealt over (default 1)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="policies simulated at once, one process each (default 1; the same results)"
    )
    parser.add_argument(
        "--shared-view",
        action="store_true",
        help="gateways read one fleet KV index and load (as through Redis); "
        "otherwise each learns from its own decisions",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=32.0,
        help="prefill cost per uncached prompt token, µs (default 32)",
    )
    parser.add_argument("--decode-ms-per-step", type=float, default=20.0, help="decode cost per step, ms (default 20)")
    parser.add_argument(
        "--host-kv-blocks",
        type=int,
        default=0,
        help="a host KV tier of this many blocks per replica (worker/host_kv_tier.py; default 0: none)",
    )
    parser.add_argument(
        "--host-copy-us-per-block",
        type=float,
        default=ReplayConfig.host_copy_us_per_block,
        help=f"a block's copy to or from the host tier, µs (default {ReplayConfig.host_copy_us_per_block:g})",
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=ReplayConfig.epsilon,
        help=f"bounded-load epsilon (default {ReplayConfig.epsilon})",
    )
    parser.add_argument(
        "--min-in-flight",
        type=int,
        default=ReplayConfig.min_in_flight,
        help=f"no replica counts as overloaded below this many in flight (default {ReplayConfig.min_in_flight})",
    )
    parser.add_argument(
        "--replica-names",
        default=None,
        metavar="A,B,...",
        help="name the replicas as a live fleet's worker ids (its gateway's hash ring; default replica-0, ...)",
    )
    parser.add_argument(
        "--model-id",
        default=REPLAY_MODEL_ID,
        help=f"model id of the block hashes: a live fleet's (e.g. sim-v1) for its gateway's keys (default "
        f"{REPLAY_MODEL_ID}; token-id traces only)",
    )
    parser.add_argument(
        "--flow-control",
        choices=("on", "off"),
        default="off",
        help="the gateways' flow control, as `kvroute gateway --flow-control`: on, requests wait in the gateway by "
        "band and tenant (the trace's) until a replica can admit them; off (default here, as the figures of "
        "docs/sim.md): each is sent at once",
    )
    parser.add_argument(
        "--routing-config",
        type=Path,
        default=None,
        metavar="PATH",
        help="a gateway's routing config: its `flow_control` (bounds, saturation, each band's max wait and SLO) is "
        "read as the gateway reads it; its other keys are left to the flags above",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG comparing the policies")


def run(args: argparse.Namespace) -> int:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for policy in policies:
        if policy not in REPLAY_POLICIES:
            raise UserError(f"unknown policy {policy!r}; choose from {', '.join(REPLAY_POLICIES)}")
    trace = load_trace(args.trace, args.block_size, args.requests, args.seed)
    freeze_start_up_heap()  # the modules and the trace: every full collection of the replay walked them again
    started = time.perf_counter()
    try:
        config = ReplayConfig(
            replicas=args.replicas,
            policies=policies,
            capacity_blocks=args.capacity_blocks,
            gateways=args.gateways,
            shared_view=args.shared_view,
            jobs=args.jobs,
            prefill_us_per_token=args.prefill_us_per_token,
            decode_ms_per_step=args.decode_ms_per_step,
            host_kv_blocks=args.host_kv_blocks,
            host_copy_us_per_block=args.host_copy_us_per_block,
            epsilon=args.epsilon,
            min_in_flight=args.min_in_flight,
            seed=args.seed,
            progress=len(trace.requests) >= 2000,
            replica_names=None if args.replica_names is None else tuple(args.replica_names.split(",")),
            model_id=args.model_id,
            flow_control=args.flow_control == "on",
            flow_settings=flow_settings(args.routing_config),
        )
        result = replay(trace, config)
    except ReplayError as exc:
        raise UserError(str(exc)) from None
    elapsed = time.perf_counter() - started
    print(format_table(result))
    print(f"replayed {result.requests:,} requests x {len(result.policies)} policies in {elapsed:.1f} s")
    if args.json is not None:
        write_output(args.json, lambda path: path.write_text(json.dumps(result.to_json(), indent=2) + "\n"))
    if args.plot is not None:
        from sim.plot import plot_result

        write_output(args.plot, lambda path: plot_result(result, path))
    return 0


def flow_settings(path: Path | None) -> FlowControlConfig:
    """The `flow_control` of a routing config file (the defaults without one); UserError naming what is wrong."""
    if path is None:
        return FlowControlConfig()
    try:
        options = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--routing-config {path}: {exc}") from None
    if not isinstance(options, dict):
        raise UserError(f"--routing-config {path}: must be a JSON object")
    try:
        return FlowControlConfig.from_routing_config(options)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_trace(spec: str, block_size: int | None, requests: int | None, seed: int) -> Trace:
    """A trace from a file path or `synthetic:NAME`; bad input raises UserError."""
    try:
        if spec.startswith(SYNTHETIC):
            return generate(spec[len(SYNTHETIC) :], requests, seed, block_size or DEFAULT_BLOCK_SIZE)
        if block_size is not None:
            raise UserError("--block-size applies to synthetic traces only (a Mooncake block is 512 tokens)")
        if requests is not None:
            raise UserError("--requests applies to synthetic traces only")
        return read_mooncake(spec)
    except (TraceError, WorkloadError) as exc:
        raise UserError(str(exc)) from None


def write_output(path: Path, write) -> None:
    try:
        write(path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"wrote {path}", file=sys.stderr)


def format_table(result: ReplayResult) -> str:
    """One row per policy, the oracle and the ideal, aligned; busy time per replica as max / mean and min / mean.
    The oracle is labelled as what it is (a bounded longest-prefix yardstick: a policy may beat it), the ideal as
    the lower bound no routing can beat."""
    gateways = result.config.gateways
    header = [
        "policy",
        "prefill tokens",
        "x yardstick",
        "x ideal",
        "hit rate",
        "busy max/mean",
        "min/mean",
        "TTFT p50 ms",
        "p90",
        "p99",
        "requests/replica min-max",
    ]
    if gateways > 1:
        header.append(f"hit loss vs 1 gateway ({'shared' if result.config.shared_view else 'own'} view)")
    rows = []
    for name, p in result.policies.items():
        row = [
            f"{name} (bounded longest-prefix yardstick, not an optimum)" if name == ORACLE else name,
            f"{p.prefill_tokens:,}",
            f"{p.prefill_tokens / result.oracle_prefill_tokens:.3f}",
            f"{p.prefill_tokens / result.ideal_prefill_tokens:.3f}",
            f"{p.hit_rate:.3f}",
            f"{p.load_imbalance:.3f}",
            f"{p.busy_min_share:.3f}",
            f"{p.ttft_ms['p50']:.0f}",
            f"{p.ttft_ms['p90']:.0f}",
            f"{p.ttft_ms['p99']:.0f}",
            f"{min(p.per_replica_requests)}-{max(p.per_replica_requests)}",
        ]
        if gateways > 1:
            row.append("" if p.vs_one_gateway is None else f"{100 * p.vs_one_gateway:.1f}%")
        rows.append(row)
    ideal = [
        "ideal (one unlimited cache): lower bound",
        f"{result.ideal_prefill_tokens:,}",
        f"{result.ideal_prefill_tokens / result.oracle_prefill_tokens:.3f}",
        "1.000",
        f"{result.ideal_hit_rate:.3f}",
    ]
    rows.append(ideal + [""] * (len(header) - len(ideal)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"{result.trace}: {result.requests:,} requests, {result.input_tokens:,} prompt tokens, "
        f"{result.config.replicas} replicas x {result.config.capacity_blocks:,} blocks, {gateways} gateway(s)"
    ]
    for row in [header, *rows]:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
    d = result.divergence
    histogram = ", ".join(f"{k}: {v}" for k, v in d.buckets.items()) or "none"
    lines.append(
        f"first divergence from the session's previous request ({d.unit}): {histogram}; "
        f"first of session: {d.first_of_session}"
    )
    if result.config.flow_control or any(len(p.bands) > 1 for p in result.policies.values()):
        lines += format_bands(result)
    return "\n".join(lines)


def format_bands(result: ReplayResult) -> list[str]:
    """One line per policy and band: goodput (its SLO from the routing config), TTFT and the time queued in the
    gateway, flow control's sheds and dispatches."""
    lines = [f"per band (flow control {'on' if result.config.flow_control else 'off'}):"]
    for name, p in result.policies.items():
        for band, b in p.bands.items():
            sheds = ", ".join(f"{k} {v}" for k, v in b.sheds.items()) or "none"
            sent = ", ".join(f"{k} {v}" for k, v in b.dispatches.items()) or "-"
            lines.append(
                f"  {name} priority {band}: {b.requests:,} requests, goodput {b.goodput:.1%}, TTFT p50/p99 "
                f"{b.ttft_ms['p50']:.0f}/{b.ttft_ms['p99']:.0f} ms, queued in the gateway p50/p99 "
                f"{b.gateway_wait_ms['p50']:.0f}/{b.gateway_wait_ms['p99']:.0f} ms; shed: {sheds}; sent: {sent}"
            )
    return lines
