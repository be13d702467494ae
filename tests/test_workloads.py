"""The seeds' worked numbers, through the real block manager and replay (block size 16)."""

import pytest

from loadtest.replay import ReplayConfig, replay
from loadtest.workloads import WorkloadError, generate


def run(name: str, requests: int | None = None, replicas: int = 1, capacity: int = 10_000, seed: int = 0):
    trace = generate(name, requests, seed=seed)
    config = ReplayConfig(replicas=replicas, policies=("round_robin",), capacity_blocks=capacity)
    return trace, replay(trace, config)


def test_support_request_id_on_line_2_vs_at_the_end():
    _, early = run("support", 50)
    _, late = run("support-id-at-end", 50)
    assert all(r.input_length == 3300 for r in generate("support", 5).requests)
    assert early.policies["round_robin"].cached_tokens[1:] == [32] * 49  # 32 / 3,300: about 1%
    assert late.policies["round_robin"].cached_tokens[1:] == [2896] * 49  # 181 blocks: about 88%
    assert 2896 / 3300 == pytest.approx(0.88, abs=0.005)
    assert early.policies["round_robin"].hit_rate == pytest.approx(0.01, abs=0.002)
    assert late.policies["round_robin"].hit_rate == pytest.approx(0.86, abs=0.02)


def test_multiturn_six_turns_cost_12600_without_reuse_and_1640_with_a_prefix_cache():
    trace, result = run("multiturn", 6)
    assert [r.input_length for r in trace.requests] == [1100, 1500, 1900, 2300, 2700, 3100]
    assert trace.input_tokens == 12_600
    assert result.policies["round_robin"].prefill_tokens == 1100 + 5 * 108 == 1640
    assert result.ideal_prefill_tokens == 1640


def test_multiturn_trimming_the_oldest_turn_costs_about_2100_per_turn():
    trace, result = run("multiturn-trim", 10)
    prefill = [
        r.input_length - c for r, c in zip(trace.requests, result.policies["round_robin"].cached_tokens, strict=True)
    ]
    assert prefill[:6] == [1100] + [108] * 5
    assert prefill[6:] == [3100 - 992] * 4  # only the 62 blocks of the system prompt survive


def test_rag_passage_order():
    shuffled, rs = run("rag-shuffled", 5)
    _, rz = run("rag-sorted", 5)
    assert all(r.input_length == 800 + 5 * 300 + 50 == 2350 for r in shuffled.requests)
    assert rs.policies["round_robin"].cached_tokens[1:] == [800] * 4  # 34%
    assert rz.policies["round_robin"].cached_tokens[1:] == [2288] * 4  # 143 blocks of 2,300 shared
    assert 800 / 2350 == pytest.approx(0.34, abs=0.005)
    assert 2288 / 2350 == pytest.approx(0.98, abs=0.01)


def test_only_full_blocks_are_reusable():
    trace = generate("repeat", 2)  # one 512-token prompt, twice
    result = replay(trace, ReplayConfig(replicas=1, policies=("round_robin",)))
    assert result.policies["round_robin"].cached_tokens == [0, 496]  # the last token is always computed
    assert 16 * (1500 // 16) == 1488


def test_round_robin_over_4_replicas_finds_the_holder_about_1_in_4():
    _, result = run("repeat", 800, replicas=4)
    repeats = result.policies["round_robin"].cached_tokens[400:]
    assert sum(c > 0 for c in repeats) / len(repeats) == pytest.approx(0.25, abs=0.06)


@pytest.mark.parametrize("slots, hits", [(4, 0), (5, 5)])
def test_lru_churn_five_prefixes_twice(slots, hits):
    _, result = run("lru-churn", 10, capacity=slots * 4)  # a prefix is 4 blocks: one slot
    assert sum(c > 0 for c in result.policies["round_robin"].cached_tokens) == hits


def test_tenants_never_share_blocks_across_salts():
    trace, result = run("tenants", 8)
    cached = result.policies["round_robin"].cached_tokens
    assert len({r.cache_salt for r in trace.requests}) == 4
    assert len({r.token_ids[:1000] for r in trace.requests}) == 1  # the same system prompt text
    assert cached[:4] == [0, 0, 0, 0]  # each tenant's first request: no hit across salts
    assert cached[4:] == [992] * 4


def test_agents_share_the_tool_schema_and_their_own_history():
    trace, result = run("agents", 16)
    cached = result.policies["round_robin"].cached_tokens
    assert cached[0] == 0 and all(c >= 1984 for c in cached[1:])  # 124 blocks of the 2,000-token schema
    later = [c for r, c in zip(trace.requests, cached, strict=True) if r.input_length > 2400]
    assert later and all(c > 2200 for c in later)  # a later step reuses its own history too


def test_unknown_workload_and_bad_sizes():
    with pytest.raises(WorkloadError, match="unknown workload 'chat'"):
        generate("chat")
    with pytest.raises(WorkloadError, match="requests must be >= 1"):
        generate("support", 0)
