"""`kvroute bench --plot`: TTFT and E2E CDFs and the per-worker load of live runs, on the replay's panels
(sim.plot); matplotlib's object API on the Agg canvas, as there."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from loadtest.bench_stats import RequestRecord
from sim.plot import cdf_line, grouped_bars


def plot_runs(runs: dict[str, tuple[list[RequestRecord], dict[str, int]]], path: Path, title: str) -> None:
    """TTFT and E2E CDFs (one line per run) and requests per worker (run name -> (records, worker -> requests)).
    Matplotlib's object API on the Agg canvas: no display needed, no global backend changed."""
    fig = Figure(figsize=(16, 4.8))
    ttft_ax, e2e_ax, load_ax = fig.subplots(1, 3)
    fig.suptitle(title)
    for ax, attribute, label in ((ttft_ax, "ttft_s", "TTFT"), (e2e_ax, "e2e_s", "E2E")):
        for name, (records, _) in runs.items():
            cdf_line(ax, [getattr(r, attribute) * 1e3 for r in records if r.ok and getattr(r, attribute)], name)
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{label} CDF")
        if ax.lines:
            ax.legend(fontsize=8)
    workers = sorted({w for _, per_worker in runs.values() for w in per_worker})
    counts = {name: [per_worker.get(w, 0) for w in workers] for name, (_, per_worker) in runs.items()}
    grouped_bars(load_ax, counts, workers, "worker", "requests served", "per-worker load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
