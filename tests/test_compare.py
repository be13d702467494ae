"""`kvroute bench --compare`'s prediction: the time to first token outside the engines, from the workers' own
TTFT histogram and the client's TTFTs."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from loadtest.bench_stats import RequestRecord, summarize
from loadtest.compare import (
    Entry,
    FleetConfig,
    RouterFleet,
    RunResult,
    histogram_quantile,
    outside_engine_ms,
    peer_binary,
)

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
    return RunResult(Entry("kvroute", "kv_aware"), records, summarize(records, 30.0), workers, {}, 64)


def test_a_quantile_is_read_linearly_within_its_bucket_as_prometheus_reads_it():
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: half way through (0.1, 0.2]
    assert histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # from 0 below the first bound
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.4)
    assert histogram_quantile(0.5, [(0.1, 1.0), (math.inf, 4.0)]) == 0.1  # in +Inf: the last finite bound


def test_the_time_outside_the_engines_is_the_shift_of_the_median():
    """Engine TTFTs spread over 20-100 ms, 8 ms more for each at the client: 8 ms, within the reading of the
    workers' median from its 20 ms wide bucket; without figures, 0."""
    engine_s = list(np.random.default_rng(0).uniform(0.02, 0.1, 400))
    assert outside_engine_ms(run_of(engine_s, [0.008] * 400)) == pytest.approx(8.0, abs=1.5)
    assert outside_engine_ms(run_of([], [])) == 0.0


def test_a_tail_outside_the_engines_moves_the_median_less_than_the_mean():
    """Three requests in ten wait 100 ms more outside the engines (a busy event loop): the mean shift is 38 ms,
    the median's, which the prediction's median adds to, stays far closer to the common 8 ms."""
    engine_s = list(np.random.default_rng(1).uniform(0.02, 0.04, 400))
    outside_s = [0.108 if i % 10 < 3 else 0.008 for i in range(400)]
    run = run_of(engine_s, outside_s)
    client_ms = np.asarray([r.ttft_s for r in run.records]) * 1e3
    assert client_ms.mean() - np.mean(engine_s) * 1e3 == pytest.approx(38.0, abs=0.5)
    assert 8.0 <= outside_engine_ms(run) <= 16.0


def test_a_median_read_from_a_wide_bucket_stays_between_zero_and_the_mean_shift():
    """Engine TTFTs of 2.6-4.4 s, the client's 20 ms later. In vLLM's (2.5, 5] bucket the histogram's median
    is 3.75 s, 0.25 s above the exact one, so the reading would be negative: kept at 0 or above. With the
    median in the +Inf bucket above 3 s, it is read as 3 s, 0.5 s too low: kept at the exact mean shift."""
    engine_s = [2.6 + 0.0045 * i for i in range(400)]
    run = run_of(engine_s, [0.02] * 400)
    run.workers["ttft_buckets"] = {"2.5": 0, "5.0": 400, "+Inf": 400}
    assert outside_engine_ms(run) == 0.0
    run.workers["ttft_buckets"] = {"2.0": 0, "3.0": 89, "+Inf": 400}
    assert outside_engine_ms(run) == pytest.approx(20.0)


def test_vllm_routers_kv_aware_is_given_every_workers_kv_event_sources(tmp_path):
    """vllm-router's `kv_aware` routes from each worker's ZMQ KV events, named by `--kv-event-source` (and
    replay, block size, model): the fleet behind it publishes them and the router subscribes to every worker's,
    rather than scoring by load only. The router's own start-up log says which sources it uses."""
    if peer_binary("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install 'kvroute[peers]')")
    config = FleetConfig(workers=2, model="sim", seed=0, num_kv_blocks=256)
    with RouterFleet(Entry("vllm-router", "kv_aware"), config, tmp_path) as fleet:
        log = tmp_path / "vllm-router-kv_aware.log"
        deadline = time.monotonic() + 30
        while len(static_sources(log)) < len(fleet.workers):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        for worker, line in zip(fleet.workers, static_sources(log), strict=True):
            assert f'worker_url="{worker.http_url}"' in line and "model=sim block_size=16" in line, line


def static_sources(log: Path) -> list[str]:
    """vllm-router's start-up lines naming a worker's static KV event source, its colour codes removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()) if log.exists() else ""
    return [line for line in text.splitlines() if "using configured static KV event sources" in line]
