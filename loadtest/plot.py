"""`kvroute replay --plot`: one PNG comparing the policies.

Uses matplotlib's object API (a `Figure` rendered by the Agg canvas), never pyplot, so it needs no
display and changes no global backend of the caller.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from loadtest.replay import ReplayResult


def plot_result(result: ReplayResult, path: Path) -> None:
    """Three panels: prefill tokens per policy against the ideal, the TTFT CDF, and per-replica load."""
    names = list(result.policies)
    fig = Figure(figsize=(16, 4.8))
    tokens_ax, ttft_ax, load_ax = fig.subplots(1, 3)
    fig.suptitle(
        f"{result.trace}: {result.requests:,} requests, {result.config.replicas} replicas "
        f"x {result.config.capacity_blocks:,} blocks"
    )

    values = [result.policies[n].prefill_tokens / 1e6 for n in names] + [result.ideal_prefill_tokens / 1e6]
    bars = tokens_ax.bar(names + ["ideal"], values, color=["C0"] * len(names) + ["C7"])
    tokens_ax.bar_label(bars, fmt="%.2f", fontsize=8)
    tokens_ax.set_ylabel("prefill tokens (millions)")
    tokens_ax.set_title("prefill tokens computed")
    tokens_ax.tick_params(axis="x", rotation=20)

    for name in names:
        samples = np.sort(np.asarray(result.policies[name].ttft_samples_ms))
        ttft_ax.plot(samples, np.arange(1, len(samples) + 1) / len(samples), label=name)
    ttft_ax.set_xscale("log")
    ttft_ax.set_xlabel("TTFT (ms, simulated)")
    ttft_ax.set_ylabel("share of requests")
    ttft_ax.set_title("TTFT CDF")
    ttft_ax.legend(fontsize=8)

    width = 0.8 / len(names)
    for i, name in enumerate(names):
        busy = result.policies[name].per_replica_busy_s
        load_ax.bar(np.arange(len(busy)) + i * width, busy, width, label=name)
    load_ax.set_xlabel("replica")
    load_ax.set_ylabel("busy time (s, simulated)")
    load_ax.set_title("per-replica load")
    load_ax.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=100)
