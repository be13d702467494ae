"""The worker keeps headroom (worker/scheduler.py, "Headroom"): with a decode reserve, a burst larger than the
KV pool waits in the queue instead of being admitted on its prompts' blocks and preempting as it decodes. The
sim engine on a virtual clock (deterministic, no wall time), the block-pool invariants checked after every step,
and `vllm:num_preemptions_total` read as a scrape stores it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.sampling import SamplingParams
from worker.clock import VirtualClock
from worker.config import EngineConfig
from worker.engine import LLMEngine, RequestOutput
from worker.metrics import WorkerMetrics
from worker.sim_runner import SimRunner

# A burst of 24 chats of 96 prompt tokens and 128 answer tokens each on a pool of 96 blocks of 16 tokens: the
# prompts alone fit 14 at a time (7 blocks each), the whole requests 6 (14 blocks each).
BURST, PROMPT_TOKENS, ANSWER_TOKENS, NUM_BLOCKS = 24, 96, 128, 96


@dataclass
class BurstRun:
    preemptions: int
    ttft_mean_s: float
    finished_at_s: float  # the virtual time the last request finished
    tokens_per_s: float  # generated tokens / finished_at_s
    scraped_preemptions: float
    per_request_preemptions: int  # the requests' own tallies (RequestTimings.preemptions), summed


def run_burst(decode_reserve_tokens: int) -> BurstRun:
    config = EngineConfig(
        model="sim", num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=512, decode_reserve_tokens=decode_reserve_tokens,
        sim_prefill_us_per_token=100.0, sim_decode_ms_per_step=10.0,
    )  # fmt: skip
    runner = SimRunner(config, clock=VirtualClock(), outputs=lambda seq: 7)
    engine = LLMEngine(config, clock=runner.clock, sim_runner=runner)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True)
    for i in range(BURST):
        engine.add_request(f"r{i}", [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)], params)
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
        engine.check_invariants()
    assert len(finished) == BURST and engine.stats().num_blocks_used == 0
    timings = [out.timings for out in finished if out.timings is not None]
    assert len(timings) == BURST
    assert all(t.first_token is not None and t.last_token is not None for t in timings)
    ttfts = [t.first_token - t.arrival for t in timings if t.first_token is not None]
    end = max(t.last_token for t in timings if t.last_token is not None) - min(t.arrival for t in timings)
    metrics = WorkerMetrics("sim", engine.stats)
    scraped = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
    }
    return BurstRun(
        preemptions=engine.stats().num_preemptions,
        ttft_mean_s=sum(ttfts) / len(ttfts),
        finished_at_s=end,
        tokens_per_s=BURST * ANSWER_TOKENS / end,
        scraped_preemptions=scraped["vllm:num_preemptions_total"],
        per_request_preemptions=sum(t.preemptions for t in timings),
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, BurstRun]:
    default = EngineConfig().decode_reserve_tokens
    return {"off": run_burst(0), "default": run_burst(default), "whole answers": run_burst(ANSWER_TOKENS)}


def test_the_default_reserve_cuts_a_bursts_preemptions_at_no_cost_in_throughput(runs: dict[str, BurstRun]) -> None:
    off, default = runs["off"], runs["default"]
    print(f"burst of {BURST}: off {off}; default reserve {default}")
    assert off.preemptions >= BURST // 2, "without the reserve the burst preempts (the case the reserve is for)"
    assert default.preemptions <= off.preemptions // 2
    assert default.tokens_per_s >= off.tokens_per_s


def test_a_reserve_of_whole_answers_queues_the_burst_without_a_preemption(runs: dict[str, BurstRun]) -> None:
    """The trade docs/worker.md states: none thrown away, at a cost in throughput where a bigger decode batch
    costs nothing more (the sim's cost model, as a GPU's memory-bound decode)."""
    assert runs["whole answers"].preemptions == 0
    assert runs["whole answers"].tokens_per_s < runs["off"].tokens_per_s


def test_every_preemption_is_counted_under_vllms_name(runs: dict[str, BurstRun]) -> None:
    for run in runs.values():
        assert run.scraped_preemptions == run.preemptions == run.per_request_preemptions


def test_a_negative_reserve_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="decode_reserve_tokens"):
        EngineConfig(decode_reserve_tokens=-1).validate()
