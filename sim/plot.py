"""`kvroute replay --plot`: one PNG comparing the policies, from panels `kvroute bench --plot` shares (loadtest.plot).

Uses matplotlib's object API (a `Figure` rendered by the Agg canvas), never pyplot, so it needs no
display and changes no global backend of the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from sim.replay import ReplayResult


def cdf_line(ax: Axes, values: list[float], label: str) -> None:
    """One empirical CDF: the share of samples at or below each value."""
    ordered = np.sort(np.asarray(values))
    if len(ordered):
        ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)


def grouped_bars(
    ax: Axes, series: Mapping[str, Sequence[float]], categories: list[str], xlabel: str, ylabel: str, title: str
) -> None:
    """One bar per (series, category), the series side by side within each category."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(np.arange(len(values)) + i * width, values, width, label=name)
    ax.set_xticks(np.arange(len(categories)) + width * (len(series) - 1) / 2, categories)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


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
        cdf_line(ttft_ax, result.policies[name].ttft_samples_ms, name)
    ttft_ax.set_xscale("log")
    ttft_ax.set_xlabel("TTFT (ms, simulated)")
    ttft_ax.set_ylabel("share of requests")
    ttft_ax.set_title("TTFT CDF")
    ttft_ax.legend(fontsize=8)

    busy = {name: list(result.policies[name].per_replica_busy_s) for name in names}
    replicas = [str(i) for i in range(result.config.replicas)]
    grouped_bars(load_ax, busy, replicas, "replica", "busy time (s, simulated)", "per-replica load")

    fig.tight_layout()
    fig.savefig(path, dpi=100)
