"""`kvroute bench --compare`'s prediction: the time to first token outside the engines, from the workers' own
TTFT histogram and the client's TTFTs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.bench_stats import SLO, RequestRecord, summarize
from loadtest.compare import Entry, RunResult, outside_engine_ms

# vLLM's TTFT buckets (worker.metrics.TTFT_BUCKETS) up to 2.5 s, then +Inf.
BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, math.inf)


def run_of(engine_s: list[float], outside_s: list[float]) -> RunResult:
    """A run whose workers saw `engine_s` as their TTFTs and whose client saw each plus `outside_s`."""
    records = [
        RequestRecord(i, 0.1 * i, ttft_s=e + o, e2e_s=e + o + 0.5, output_tokens=10)
        for i, (e, o) in enumerate(zip(engine_s, outside_s, strict=True))
    ]
    ordered = np.sort(engine_s)
    workers = {
        "ttft_buckets": {str(b): int(np.searchsorted(ordered, b, side="right")) for b in BOUNDS},
        "ttft_ms_mean": float(np.mean(engine_s)) * 1e3 if engine_s else 0.0,
    }
    return RunResult(Entry("kvroute", "kv_aware"), records, summarize(records, 30.0, SLO()), workers, {}, 64)


def test_the_time_outside_the_engines_is_read_at_the_histograms_bounds_not_within_its_wide_buckets():
    """Engine TTFTs from 20 ms to 400 ms (the 0.1-0.25 s bucket alone is 150 ms wide), 8 ms outside: 8 ms."""
    rng = np.random.default_rng(0)
    engine_s = list(rng.uniform(0.02, 0.4, 300))
    assert outside_engine_ms(run_of(engine_s, [0.008] * 300)) == pytest.approx(8.0, abs=1.0)


def test_a_tail_outside_the_engines_moves_the_middle_less_than_the_mean():
    """One request in ten waits 300 ms more outside the engines (a stalled event loop): the mean shift is 38 ms,
    the shift in the middle of the distribution, which a median adds to, is near the common 8 ms."""
    rng = np.random.default_rng(1)
    engine_s = list(rng.uniform(0.02, 0.06, 400))
    outside_s = [0.308 if i % 10 == 0 else 0.008 for i in range(400)]
    run = run_of(engine_s, outside_s)
    assert 8.0 <= outside_engine_ms(run) <= 14.0
    client_mean_ms = np.mean([r.ttft_s for r in run.records]) * 1e3
    assert client_mean_ms - run.workers["ttft_ms_mean"] == pytest.approx(38.0, abs=0.5)


def test_without_a_bound_in_the_middle_it_is_the_difference_of_the_means_and_without_figures_zero():
    engine_s = [0.11 + 0.0004 * i for i in range(200)]  # all within (0.1, 0.25]
    assert outside_engine_ms(run_of(engine_s, [0.008] * 200)) == pytest.approx(8.0)
    empty = run_of([], [])
    assert outside_engine_ms(empty) == 0.0
