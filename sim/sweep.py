"""`kvroute sweep TRACE --sweep replicas=2,4,8,16 --sweep capacity-blocks=500,2000`: capacity planning.

The replay (sim.replay) run over a grid of fleet sizes and cache sizes, every point on the same
trace with the same seed and policies. It answers, for a user's own trace: what fraction of the traffic
repeats (the ideal: one unlimited cache), and how many replicas and how much cache per replica it takes
to keep that reuse (hit rate, prefill tokens and the cost model's TTFT per point and policy). For each
policy it names the smallest fleet (fewest KV blocks in all, then fewest replicas) whose hit rate
reaches `--target` of the ideal's.

Axes: `replicas`, `capacity-blocks` (KV blocks per replica) and `host-kv-blocks` (a host KV tier's blocks per
replica, 0 for none: how much host memory is worth buying, docs/worker.md "The host KV tier"); an axis not swept
takes its single value from `--replicas` / `--capacity-blocks` / `--host-kv-blocks`. Every other option is the
replay's (`kvroute replay`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from kvroute.heap import freeze_start_up_heap
from sim.replay import ORACLE, REPLAY_POLICIES, ReplayConfig, ReplayError, ReplayResult, replay
from sim.replay_cli import load_trace, write_output
from sim.traces import Trace
from sim.workloads import WORKLOAD_NAMES

AXES = {"replicas": "replicas", "capacity-blocks": "capacity_blocks", "host-kv-blocks": "host_kv_blocks"}
MAX_POINTS = 64  # a grid past this is a typo more often than a plan, and each point replays the whole trace


@dataclass(frozen=True)
class Point:
    """One grid point's result for one policy."""

    replicas: int
    capacity_blocks: int
    policy: str
    prefill_tokens: int
    hit_rate: float
    ttft_ms: dict[str, float]
    load_imbalance: float
    host_kv_blocks: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "capacity_blocks": self.capacity_blocks,
            "host_kv_blocks": self.host_kv_blocks,
            "policy": self.policy,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "ttft_ms": {k: round(v, 3) for k, v in self.ttft_ms.items()},
            "load_imbalance": round(self.load_imbalance, 4),
        }


@dataclass(frozen=True)
class Sweep:
    trace: str
    requests: int
    input_tokens: int
    ideal_prefill_tokens: int
    points: tuple[Point, ...]
    target: float

    @property
    def ideal_hit_rate(self) -> float:
        return 1 - self.ideal_prefill_tokens / self.input_tokens

    def smallest(self, policy: str) -> Point | None:
        """The cheapest point (fewest device blocks in all, then fewest host blocks, then fewest replicas) where
        `policy` keeps `target` of the ideal's hit rate; None when no point does."""
        goal = self.target * self.ideal_hit_rate
        keeping = [p for p in self.points if p.policy == policy and p.hit_rate >= goal]
        return min(
            keeping,
            key=lambda p: (p.replicas * p.capacity_blocks, p.replicas * p.host_kv_blocks, p.replicas),
            default=None,
        )

    def to_json(self) -> dict[str, Any]:
        policies = sorted({p.policy for p in self.points})
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "ideal": {"prefill_tokens": self.ideal_prefill_tokens, "hit_rate": round(self.ideal_hit_rate, 6)},
            "target": self.target,
            "points": [p.to_json() for p in self.points],
            "smallest": {n: (s.to_json() if (s := self.smallest(n)) else None) for n in policies},
        }


def parse_axes(
    specs: list[str], replicas: int, capacity_blocks: int, host_kv_blocks: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """`--sweep AXIS=V1,V2,...` (repeatable) into the replicas, capacity and host-tier values; bad input raises
    UserError."""
    values: dict[str, list[int]] = {
        "replicas": [replicas],
        "capacity-blocks": [capacity_blocks],
        "host-kv-blocks": [host_kv_blocks],
    }
    seen: set[str] = set()
    for spec in specs:
        axis, sep, text = spec.partition("=")
        axis = axis.strip()
        if not sep or axis not in AXES:
            raise UserError(f"--sweep {spec!r}: expected AXIS=V1,V2,... with AXIS one of {', '.join(AXES)}")
        if axis in seen:
            raise UserError(f"--sweep {axis} given twice")
        seen.add(axis)
        try:
            parsed = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"--sweep {axis}: values must be integers, got {text!r}") from None
        least = 0 if axis == "host-kv-blocks" else 1
        if not parsed or min(parsed) < least:
            raise UserError(f"--sweep {axis}: need one or more integers >= {least}, got {text!r}")
        values[axis] = sorted(set(parsed))
    grid = len(values["replicas"]) * len(values["capacity-blocks"]) * len(values["host-kv-blocks"])
    if grid > MAX_POINTS:
        raise UserError(f"--sweep: {grid} grid points, at most {MAX_POINTS}")
    return values["replicas"], values["capacity-blocks"], values["host-kv-blocks"]


def sweep(
    trace: Trace,
    base: ReplayConfig,
    replicas: list[int],
    capacities: list[int],
    target: float,
    progress: bool = True,
    hosts: list[int] | None = None,
) -> Sweep:
    """Replay `trace` at every (replicas, capacity, host tier) point with `base`'s other settings (`hosts`
    default: `base`'s host tier alone)."""
    points: list[Point] = []
    first: ReplayResult | None = None
    hosts = hosts or [base.host_kv_blocks]
    grid = [(n, b, h) for n in replicas for b in capacities for h in hosts]
    for i, (n, blocks, host) in enumerate(grid, start=1):
        where = f"{n} replicas x {blocks:,} blocks" + (f" + {host:,} host blocks" if host else "")
        if progress:
            print(f"[{i}/{len(grid)}] {where}", file=sys.stderr)
        try:
            result = replay(trace, replace(base, replicas=n, capacity_blocks=blocks, host_kv_blocks=host))
        except ReplayError as exc:
            raise UserError(f"{where}: {exc}") from None
        first = first or result
        for name, p in result.policies.items():
            points.append(Point(n, blocks, name, p.prefill_tokens, p.hit_rate, p.ttft_ms, p.load_imbalance, host))
    assert first is not None
    return Sweep(trace.name, first.requests, first.input_tokens, first.ideal_prefill_tokens, tuple(points), target)


def format_table(result: Sweep) -> str:
    """One row per (replicas, capacity, host tier, policy), then each policy's smallest fleet that keeps the target.
    The host column shows only where a point has a host tier."""
    tiered = any(p.host_kv_blocks for p in result.points)
    header = ["replicas", "blocks/replica", "policy", "prefill tokens", "x ideal", "hit rate", "TTFT p50 ms", "p99"]
    if tiered:
        header.insert(2, "host blocks/replica")
    rows = [
        [
            str(p.replicas),
            f"{p.capacity_blocks:,}",
            *([f"{p.host_kv_blocks:,}"] if tiered else []),
            p.policy,
            f"{p.prefill_tokens:,}",
            f"{p.prefill_tokens / result.ideal_prefill_tokens:.3f}",
            f"{p.hit_rate:.3f}",
            f"{p.ttft_ms['p50']:.0f}",
            f"{p.ttft_ms['p99']:.0f}",
        ]
        for p in result.points
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"{result.trace}: {result.requests:,} requests, {result.input_tokens:,} prompt tokens; ideal (one unlimited "
        f"cache): {result.ideal_prefill_tokens:,} prefill tokens, hit rate {result.ideal_hit_rate:.3f}"
    ]
    for row in [header, *rows]:
        policy_column = 3 if tiered else 2
        lines.append(
            "  ".join(
                c.ljust(w) if i == policy_column else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    goal = result.target * result.ideal_hit_rate
    for policy in dict.fromkeys(p.policy for p in result.points):
        best = result.smallest(policy)
        host = f" + {best.host_kv_blocks:,} host blocks" if best and best.host_kv_blocks else ""
        where = (
            f"{best.replicas} replicas x {best.capacity_blocks:,} blocks{host} (hit rate {best.hit_rate:.3f})"
            if best
            else "no point of the grid"
        )
        lines.append(f"{policy}: hit rate >= {goal:.3f} ({result.target:.0%} of the ideal's) from {where}")
    return "\n".join(lines)


def plot_sweep(result: Sweep, path: Path) -> None:
    """Hit rate, prefill tokens and TTFT p50 against fleet size: a colour per policy, a line style per cache
    size, the ideal as a grey line. Matplotlib's object API only (no pyplot, no global backend)."""
    from matplotlib.figure import Figure

    policies = list(dict.fromkeys(p.policy for p in result.points))
    capacities = sorted({(p.capacity_blocks, p.host_kv_blocks) for p in result.points})
    replicas = sorted({p.replicas for p in result.points})
    styles = ["-", "--", ":", "-."]
    fig = Figure(figsize=(16, 4.8))
    axes = fig.subplots(1, 3)
    fig.suptitle(f"{result.trace}: {result.requests:,} requests, capacity sweep")
    panels = [
        ("hit rate", lambda p: p.hit_rate, result.ideal_hit_rate),
        ("prefill tokens (millions)", lambda p: p.prefill_tokens / 1e6, result.ideal_prefill_tokens / 1e6),
        ("TTFT p50 ms (cost model)", lambda p: p.ttft_ms["p50"], None),
    ]
    for ax, (label, value, ideal) in zip(axes, panels, strict=True):
        for ci, policy in enumerate(policies):
            for si, (blocks, host) in enumerate(capacities):
                pts = sorted(
                    (
                        p
                        for p in result.points
                        if p.policy == policy and (p.capacity_blocks, p.host_kv_blocks) == (blocks, host)
                    ),
                    key=lambda p: p.replicas,
                )
                ax.plot(
                    [p.replicas for p in pts],
                    [value(p) for p in pts],
                    color=f"C{ci}",
                    linestyle=styles[si % len(styles)],
                    marker="o",
                    markersize=3,
                    label=f"{policy}, {blocks:,} blocks" + (f" + {host:,} host" if host else ""),
                )
        if ideal is not None:
            ax.axhline(ideal, color="0.5", linewidth=1, label="ideal (one unlimited cache)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(replicas, [str(n) for n in replicas])
        if ideal is None:  # an under-provisioned point's queue is minutes long against milliseconds elsewhere
            ax.set_yscale("symlog", linthresh=10)
            ax.set_ylim(bottom=0)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help=f"Mooncake JSONL (optionally .gz) or synthetic:NAME; NAME: {', '.join(WORKLOAD_NAMES)}",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="AXIS=V1,V2,...",
        help="an axis to sweep, repeatable: replicas=2,4,8,16, capacity-blocks=500,2000,8000 or "
        "host-kv-blocks=0,2000,8000",
    )
    parser.add_argument("--replicas", type=int, default=4, help="replicas where not swept (default 4)")
    parser.add_argument(
        "--capacity-blocks", type=int, default=10_000, help="KV blocks per replica where not swept (default 10000)"
    )
    parser.add_argument(
        "--host-kv-blocks", type=int, default=0, help="host KV tier blocks per replica where not swept (default 0)"
    )
    parser.add_argument(
        "--host-copy-us-per-block",
        type=float,
        default=ReplayConfig.host_copy_us_per_block,
        help=f"a block's copy to or from the host tier, µs (default {ReplayConfig.host_copy_us_per_block:g})",
    )
    parser.add_argument(
        "--policies",
        default="round_robin,prefix,kv_aware",
        help=f"comma list from: {', '.join(REPLAY_POLICIES)} (default round_robin,prefix,kv_aware; "
        f"{ORACLE} always runs)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="the share of the ideal's hit rate a fleet must keep to count as big enough (default 0.95)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per block, synthetic traces only")
    parser.add_argument("--requests", type=int, default=None, help="requests to generate (synthetic traces)")
    parser.add_argument("--seed", type=int, default=0, help="generator and random-policy seed (default 0)")
    parser.add_argument("--prefill-us-per-token", type=float, default=32.0, help="prefill cost per token, µs")
    parser.add_argument("--decode-ms-per-step", type=float, default=20.0, help="decode cost per step, ms")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the grid as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the grid")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.target <= 1:
        raise UserError(f"--target must be in (0, 1], got {args.target}")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for policy in policies:
        if policy not in REPLAY_POLICIES:
            raise UserError(f"unknown policy {policy!r}; choose from {', '.join(REPLAY_POLICIES)}")
    replicas, capacities, hosts = parse_axes(args.sweep, args.replicas, args.capacity_blocks, args.host_kv_blocks)
    trace = load_trace(args.trace, args.block_size, args.requests, args.seed)
    freeze_start_up_heap()  # the modules and the trace: every full collection of the sweep walked them again
    try:
        base = ReplayConfig(
            replicas=replicas[0],
            capacity_blocks=capacities[0],
            policies=policies,
            prefill_us_per_token=args.prefill_us_per_token,
            decode_ms_per_step=args.decode_ms_per_step,
            host_copy_us_per_block=args.host_copy_us_per_block,
            seed=args.seed,
        )
    except ReplayError as exc:
        raise UserError(str(exc)) from None
    started = time.perf_counter()
    result = sweep(trace, base, replicas, capacities, args.target, hosts=hosts)
    print(format_table(result))
    print(
        f"swept {len(replicas) * len(capacities) * len(hosts)} points in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    if args.json is not None:
        write_output(args.json, lambda path: path.write_text(json.dumps(result.to_json(), indent=2) + "\n"))
    if args.plot is not None:
        write_output(args.plot, lambda path: plot_sweep(result, path))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sim.sweep ...`, the same as `kvroute sweep ...`."""
    parser = argparse.ArgumentParser(prog="kvroute sweep", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(f"kvroute sweep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
