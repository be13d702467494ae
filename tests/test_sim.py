"""The fleet simulator (sim/): real engines on a virtual clock behind real fleet books and policies."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from gateway.routing.router import make_policy
from kvroute.hashing import block_hashes
from kvroute.sampling import InvalidRequest, SamplingParams
from sim import FleetConfig, FleetSim, SimRequest, ViewTiming
from sim.oracle import BoundedOracle
from worker.clock import VirtualClock
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sim_runner import SimCostModel, SimRunner


def sim_engine(num_kv_blocks: int = 64, event_token_ids: bool = True) -> LLMEngine:
    config = EngineConfig(model="sim", num_kv_blocks=num_kv_blocks, block_size=16, max_num_batched_tokens=64)
    clock = VirtualClock()
    runner = SimRunner(config, SimCostModel(100.0, 10.0), clock=clock, outputs=lambda seq: 5 + seq.num_output_tokens)
    runner.outputs_run = lambda seq, n: [5 + seq.num_output_tokens + i for i in range(n)]
    return LLMEngine(config, clock=clock, sim_runner=runner, event_token_ids=event_token_ids)


def test_plain_decode_steps_at_once_are_the_single_steps():
    """step(n) over the steps decode_steps_ahead() names gives the tokens, books, events and clock of n steps."""
    engines = [sim_engine(), sim_engine()]
    for engine in engines:
        for i, n in enumerate((40, 23, 7)):
            engine.add_request(str(i), list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=30))
    tokens: list[dict[str, list[int]]] = [{}, {}]
    runs = 0
    while engines[0].has_unfinished_requests():
        ahead = engines[1].decode_steps_ahead()
        assert ahead == engines[0].decode_steps_ahead()
        many = engines[1].step(ahead) if ahead >= 2 else engines[1].step()
        runs += ahead >= 2
        single = [out for _ in range(max(ahead, 1)) for out in engines[0].step()]
        for outs, got in ((single, tokens[0]), (many, tokens[1])):
            for out in outs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engines[0].clock.now() == pytest.approx(engines[1].clock.now())
        assert engines[0].drain_kv_events() == engines[1].drain_kv_events()
        for engine in engines:
            engine.check_invariants()
    assert runs > 0 and not engines[1].has_unfinished_requests()
    assert tokens[0] == tokens[1] and all(len(t) == 30 for t in tokens[0].values())
    assert engines[0].stats() == engines[1].stats()
    with pytest.raises(ValueError, match="plain decode steps"):
        engines[0].add_request("x", [1] * 20, SamplingParams(max_tokens=5))
        engines[0].step(3)  # a prefill is waiting: the next step is not a plain decode


def test_without_event_token_ids_the_stored_events_name_the_same_blocks_without_tokens():
    """What a simulated replica runs (its gateways' indexes read hashes only): the same events, tokens left out."""
    engines = [sim_engine(), sim_engine(event_token_ids=False)]
    prompt = list(range(40))
    for engine in engines:
        engine.generate([prompt], SamplingParams(max_tokens=30))
    with_tokens, without = (engine.drain_kv_events() for engine in engines)
    assert [e.token_ids for e in with_tokens if e.kind == "stored"] == [
        tuple(prompt[:32]),
        tuple(prompt[32:] + [5 + i for i in range(8)]),
        tuple(5 + i for i in range(8, 24)),
    ]
    assert without == [dataclasses.replace(e, token_ids=()) for e in with_tokens]
    assert engines[0].stats() == engines[1].stats()


def test_an_in_process_callers_prompt_hashes_are_taken_only_if_they_are_the_engines_own():
    """A replica's engine takes its gateway's hashes of the prompt (LLMEngine.add_request's `prompt_hashes`) and
    keeps the prompt's list: the same tokens, books and KV events as hashing and copying it itself. Hashes under
    another salt, model id or block size are refused, and so is a bad id past the hashed blocks."""
    engines = [sim_engine(), sim_engine()]
    prompts = [list(range(40)), list(range(40)) + [99] * 8, list(range(7))]  # 2.5, 3 and 0 full blocks
    kept: list[list[int]] = []
    outputs: list[dict[str, list[int]]] = [{}, {}]
    for i, prompt in enumerate(prompts):  # one after another, so the second finds the first's blocks
        engines[0].add_request(str(i), list(prompt), SamplingParams(max_tokens=30), cache_salt="t")
        hashes = block_hashes(prompt, model_id=engines[1].model_id, cache_salt="t", block_size=16)
        kept.append(list(prompt))
        engines[1].add_request(
            str(i), kept[-1], SamplingParams(max_tokens=30), cache_salt="t", prompt_hashes=hashes, keep_prompt=True
        )
        while engines[0].has_unfinished_requests():
            for engine, got in zip(engines, outputs, strict=True):
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
                engine.check_invariants()
            assert engines[0].drain_kv_events() == engines[1].drain_kv_events()
    assert outputs[0] == outputs[1] and engines[0].stats() == engines[1].stats()
    assert engines[1].stats().prefix_hits == 32
    assert kept == [p + outputs[1][str(i)] for i, p in enumerate(prompts)], "the engine's token list is the one given"

    engine, prompt = sim_engine(), list(range(40))
    wrong = {
        "salt": block_hashes(prompt, model_id=engine.model_id, cache_salt="u", block_size=16),
        "model": block_hashes(prompt, model_id="other", cache_salt="t", block_size=16),
        "block size": block_hashes(prompt, model_id=engine.model_id, cache_salt="t", block_size=8),
        "count": block_hashes(prompt, model_id=engine.model_id, cache_salt="t", block_size=16)[:1],
    }
    for name, hashes in wrong.items():
        with pytest.raises(ValueError, match="not this engine's"):
            engine.add_request(name, prompt, SamplingParams(max_tokens=3), cache_salt="t", prompt_hashes=hashes)
    bad = prompt[:32] + [2**32]
    hashes = block_hashes(bad, model_id=engine.model_id, cache_salt="t", block_size=16)  # its 2 full blocks
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        engine.add_request("bad", bad, SamplingParams(max_tokens=3), cache_salt="t", prompt_hashes=hashes)
    assert not engine.has_unfinished_requests()


def request(at: float, prompt: list[int], max_tokens: int = 4) -> SimRequest:
    return SimRequest(at, lambda: list(prompt), len(prompt), max_tokens)


def test_a_gateway_sees_a_replicas_blocks_only_after_its_next_poll():
    """The oracle (exact index, ties to the fewest assigned) follows a cached prefix once its gateway has read
    the KV events (ViewTiming.poll_s); before, the second request goes to the other, emptier replica."""
    prompt = list(range(160))  # 10 blocks
    requests = [request(0.0, prompt), request(1.0, prompt + [7])]

    def placement(poll_s: float) -> tuple[list[int], list[int]]:
        config = FleetConfig(("a", "b"), 64, 16, timing=ViewTiming("books", "reported", poll_s=poll_s))
        run = FleetSim(config, [BoundedOracle()]).run(requests)
        return run.replica_of, run.cached_tokens

    assert placement(0.0) == ([0, 0], [0, 160])  # read at the end of the step that cached them
    assert placement(10.0) == ([0, 1], [0, 0])  # the poll at 0 s saw nothing; the next is at 10 s


def test_a_gateway_reads_a_replicas_books_as_they_stood_at_the_end_of_its_last_step():
    """A live worker reports the books of its last finished step (GetStats), not those of the step in progress:
    a request that arrives during the second prefill chunk sees the blocks of the first chunk (4 of 64), not
    the 7 the second allocated."""
    seen = []
    config = FleetConfig(("a",), 64, 16, cost=SimCostModel(100.0, 10.0), max_num_batched_tokens=64)
    fleet = FleetSim(config, [make_policy("round_robin")])
    requests = [request(0.0, list(range(100)), 5), request(0.008, list(range(500, 520)), 1)]  # chunks of 64 + 36
    fleet.run(requests, tick=lambda: seen.append(fleet.gateways[0].view.loads["a"].kv_usage))
    assert seen[1] == 4 / 64


def test_with_a_poller_per_replica_a_gateway_reads_each_replica_on_its_own_phase():
    """`poll_each`, as the embedded fleet state's one poller per worker: replica a is read at 5 s, b at 10 s
    (poll_s 10, phases spread), so a request at 6 s follows a's cached prefix; one poller for both read them
    at 0 s and next at 10 s, so it goes to the emptier b."""
    prompt = list(range(160))
    requests = [request(0.0, prompt), request(6.0, prompt + [7])]

    def placement(each: bool) -> list[int]:
        timing = ViewTiming("books", "reported", poll_s=10.0, poll_each=each)
        return FleetSim(FleetConfig(("a", "b"), 64, 16, timing=timing), [BoundedOracle()]).run(requests).replica_of

    assert placement(True) == [0, 0]
    assert placement(False) == [0, 1]


def test_poll_intervals_are_drawn_from_the_given_ranges_one_stream_per_poller():
    timing = ViewTiming(poll_s=0.1, poll_draw=((0.1, 0.105, 3.0), (0.2, 0.3, 1.0), (5.0, 6.0, 0.0)), seed=2)
    drawn = list(itertools.islice(timing.intervals(0), 400))
    assert all(0.1 <= d <= 0.105 or 0.2 <= d <= 0.3 for d in drawn)  # never the range of weight 0
    assert 0.6 < sum(d <= 0.105 for d in drawn) / len(drawn) < 0.9  # 3 to 1
    assert drawn == list(itertools.islice(timing.intervals(0), 400))  # seeded
    assert drawn != list(itertools.islice(timing.intervals(1), 400))  # another poller draws its own
    assert list(itertools.islice(ViewTiming(poll_s=0.1).intervals(0), 3)) == [0.1] * 3
    for bad in (((0.0, 0.1, 1.0),), ((0.2, 0.1, 1.0),), ((0.1, 0.2, 0.0),)):
        with pytest.raises(ValueError, match="poll_draw"):
            ViewTiming(poll_s=0.1, poll_draw=bad)


def test_a_replica_under_pressure_preempts_and_reports_at_most_its_prompt_cached():
    """The replicas are the real engine: a small cache makes it preempt and recompute, and what it reports as
    cached is its first admission's figure (never more than the prompt)."""
    requests = [request(0.001 * i, [i % 3] * 32 + list(range(1000 * i, 1000 * i + 60)), 40) for i in range(12)]
    config = FleetConfig(("a",), 24, 16, cost=SimCostModel(10.0, 5.0))
    fleet = FleetSim(config, [make_policy("round_robin")])
    run = fleet.run(requests)
    engine = fleet.replicas[0].engine
    assert engine.stats().num_preemptions > 0
    assert all(c < r.num_prompt_tokens for c, r in zip(run.cached_tokens, requests, strict=True))
    assert sum(run.cached_tokens) == engine.stats().prefix_hits  # one prefix query per request
    assert all(f > 0 for f in run.finish_s) and not engine.has_unfinished_requests()
    engine.check_invariants()


def test_a_measured_step_overhead_lengthens_every_step_runs_included():
    requests = [request(0.0, list(range(100)), 20)]  # one 10 ms prefill step, then 19 decode steps of 10 ms

    def timings(overhead_s: float) -> tuple[float, float]:
        config = FleetConfig(("a",), 64, 16, cost=SimCostModel(100.0, 10.0), step_overhead_s=overhead_s)
        run = FleetSim(config, [make_policy("round_robin")]).run(requests)
        return run.ttft_s[0], run.finish_s[0]

    assert timings(0.0) == (pytest.approx(0.010), pytest.approx(0.010 + 19 * 0.010))
    assert timings(0.001) == (pytest.approx(0.011), pytest.approx(0.011 + 19 * 0.011))


def test_a_run_records_each_requests_queue_and_prefill_and_each_replicas_steps_as_a_live_worker_counts_them():
    """Two requests on one replica whose cache holds one at a time: the second reaches the engine at the end of
    the step in progress (as on a live worker, whose engine stamps its arrival then) and queues until the first
    finishes, then prefills in one step; steps are counted as the live worker's `vllm:iteration_tokens_total`
    counts them, runs of plain decodes included."""
    requests = [request(0.0, list(range(100)), 20), request(0.001, list(range(500, 600)), 20)]
    config = FleetConfig(("a",), 8, 16, cost=SimCostModel(100.0, 10.0))  # 8 blocks: one request of 120 tokens
    fleet = FleetSim(config, [make_policy("round_robin")])
    run = fleet.run(requests)
    first_life = 0.010 + 19 * 0.010
    assert run.queue_s == [0.0, pytest.approx(first_life - 0.010)]
    assert run.prefill_s == [pytest.approx(0.010), pytest.approx(0.010)]
    assert run.ttft_s[1] == pytest.approx(first_life - 0.001 + 0.010)
    assert run.steps == [2 * 20] and run.preemptions == [0]
    assert run.steps == [fleet.replicas[0].steps]
