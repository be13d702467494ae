"""The seeds' worked numbers, through the real block manager and replay (block size 16)."""

from itertools import pairwise

import pytest

from sim.replay import ReplayConfig, replay
from sim.traces import Trace, TraceRequest
from sim.workloads import WorkloadError, generate


def run(name: str, requests: int | None = None, replicas: int = 1, capacity: int = 10_000, seed: int = 0):
    """The worked numbers are what the prompts share, not timing: with a cost-free model no request arrives
    while another is still prefilling (which would find only the blocks computed so far, as in any engine)."""
    trace = generate(name, requests, seed=seed)
    config = ReplayConfig(
        replicas=replicas,
        policies=("round_robin",),
        capacity_blocks=capacity,
        prefill_us_per_token=0,
        decode_ms_per_step=0,
    )
    return trace, replay(trace, config)


def test_support_request_id_on_line_2_vs_at_the_end():
    _, early = run("support", 50)
    _, late = run("support-id-at-end", 50)
    assert all(r.input_length == 3300 for r in generate("support", 5).requests)
    assert early.policies["round_robin"].cached_tokens[1:] == [32] * 49  # 32 / 3,300: about 1%
    assert late.policies["round_robin"].cached_tokens[1:] == [2896] * 49  # 181 blocks: about 88%
    assert late.policies["round_robin"].cached_tokens[1] / 3300 == pytest.approx(0.88, abs=0.005)
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
    assert rs.policies["round_robin"].cached_tokens[1] / shuffled.requests[1].input_length == pytest.approx(
        0.34, abs=0.005
    )
    assert rz.policies["round_robin"].cached_tokens[1] / shuffled.requests[1].input_length == pytest.approx(
        0.98, abs=0.01
    )


def test_only_full_blocks_are_reusable():
    trace = generate("repeat", 2)  # one 512-token prompt, twice
    result = replay(trace, ReplayConfig(replicas=1, policies=("round_robin",)))
    assert result.policies["round_robin"].cached_tokens == [0, 496]  # the last token is always computed
    prompt = tuple(range(1500))  # 93 full blocks and 12 tokens: the repeat reuses the 93 blocks, 1,488 tokens
    requests = (TraceRequest(0, 1500, 1, token_ids=prompt), TraceRequest(1e6, 1500, 1, token_ids=prompt))
    twice = replay(Trace("twice", "tokens", 16, requests), ReplayConfig(replicas=1, policies=("round_robin",)))
    assert twice.policies["round_robin"].cached_tokens == [0, 1488]


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


def _shared_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_platform_shape_platform_prompt_tenant_schemas_and_growing_sessions():
    trace = generate("platform", 400)
    requests = trace.requests
    assert len(requests) == 400 and all(b.arrival_ms >= a.arrival_ms for a, b in pairwise(requests))
    assert all(r.token_ids[:1500] == requests[0].token_ids[:1500] for r in requests)  # the platform prompt
    tenants = {r.session_id.split("-")[0] for r in requests}
    shares = sorted((sum(r.session_id.startswith(f"{t}-") for r in requests) / 400 for t in tenants), reverse=True)
    assert len(tenants) >= 10 and 0.2 < shares[0] < 0.45  # Zipf: the first tenant carries about 30%
    same_tenant = [r for r in requests if r.session_id.startswith("t0-")]
    assert all(_shared_prefix(same_tenant[0].token_ids, r.token_ids) >= 3500 for r in same_tenant)
    steps: dict[str, list] = {}
    for r in requests:
        if "agent" in r.session_id:
            steps.setdefault(r.session_id, []).append(r)
    grown = [s for s in steps.values() if len(s) >= 2]
    assert grown and all(b.token_ids[: a.input_length] == a.token_ids for s in grown for a, b in pairwise(s))
    assert all(b.input_length == a.input_length + 250 for s in grown for a, b in pairwise(s))
    assert 0.15 < sum("oneoff" in r.session_id for r in requests) / 400 < 0.35


def test_many_apps_shape_prefixes_from_200_to_6000_tokens():
    trace = generate("many-apps", 600)
    by_app: dict[str, list] = {}
    for r in trace.requests:
        by_app.setdefault(r.session_id, []).append(r.token_ids)
    lengths = [_shared_prefix(p[0], p[1]) for p in by_app.values() if len(p) >= 2]
    assert len(by_app) >= 15 and min(lengths) < 400 and max(lengths) > 4000
    assert all(200 <= n <= 6000 for n in lengths)


def test_hot_prompt_shape_one_prompt_at_high_load():
    trace = generate("hot-prompt", 500)
    assert len({r.token_ids[:2000] for r in trace.requests}) == 1
    assert len({r.token_ids[2000:] for r in trace.requests}) == 500
    rate = 500 / (trace.requests[-1].arrival_ms / 1000)
    assert 20 < rate < 30  # about 25 requests/s: 9 in flight per replica of 8 at 3 s each


def test_rag_middle_shape_shared_documents_between_a_system_prompt_and_the_question():
    trace = generate("rag-middle", 400)
    requests = trace.requests
    assert all(r.input_length == 600 + 3 * 400 + 60 for r in requests)
    assert all(r.token_ids[:600] == requests[0].token_ids[:600] for r in requests)
    topic = [r.token_ids for r in requests if r.session_id == requests[0].session_id]
    parts = [_shared_prefix(topic[0], t) for t in topic[1:]]
    assert {600, 1000} <= set(parts) and max(parts) <= 1800  # 0-3 shared documents, never the question
