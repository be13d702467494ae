"""`kvroute quality --plot`: one PNG of three panels: top-1 agreement by output position, KL by output position
(the short answers and the long outputs), and the flip rates with their 95% error bars. matplotlib's object API
(a Figure on the Agg canvas), as sim/plot.py, so no display and no global backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from quality.protocol import Comparison

SMOOTH_LONG = 16  # the long outputs' curves averaged over windows of this many positions


def plot_comparison(comparison: Comparison, path: Path) -> None:
    c = comparison
    fig = Figure(figsize=(15, 4.5))
    agree, kl, flips = fig.subplots(1, 3)
    agree.plot(c.top1_by_position, label=f"answers ({c.num_prompts} prompts)")
    kl.plot(c.kl_by_position, label=f"answers ({c.num_prompts} prompts)")
    if c.long is not None:
        n = c.long.num_prompts
        x, top1 = _smoothed(c.long.top1_by_position)
        agree.plot(x, top1, label=f"long outputs ({n}), teacher-forced")
        agree.plot(c.long.identical_by_position, label=f"long outputs ({n}), free-running still identical")
        kl.plot(*_smoothed(c.long.kl_by_position), label=f"long outputs ({n})")
    agree.set(xlabel="output position", ylabel="top-1 agreement", title="agreement with the reference")
    agree.set_ylim(-0.02, 1.02)
    kl.set(xlabel="output position", ylabel="KL(reference || candidate), nats", title="distance from the reference")
    kl.set_yscale("symlog", linthresh=1e-4)
    kl.set_ylim(bottom=0)
    for ax in (agree, kl):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    rates = {"noise floor": c.noise_floor, "candidate": c.flips, "above floor\n(paired)": c.flips_above_floor}
    flips.bar(
        list(rates),
        [r.value for r in rates.values()],
        yerr=[r.half_width for r in rates.values()],
        capsize=6,
        color=["tab:gray", "tab:orange", "tab:red"],
    )
    flips.axhline(0, color="black", linewidth=0.8)
    flips.set(ylabel="share of prompts", title="answers flipped against reference A (95% intervals)")
    fig.suptitle(f"kvroute quality, {c.model}: {c.reference!r} vs {c.candidate!r}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _smoothed(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Means over consecutive windows of SMOOTH_LONG positions, at each window's middle."""
    array = np.asarray(values)
    starts = np.arange(0, len(array), SMOOTH_LONG)
    return starts + (SMOOTH_LONG - 1) / 2, np.array([array[s : s + SMOOTH_LONG].mean() for s in starts])
