"""`kvroute bench`: its statistics against numpy and vLLM's definitions, workloads rendered to text, and a short
compare run over real sim workers."""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.admission.auth import Authenticator
from gateway.flow_control.config import FlowControlConfig
from kvroute.errors import UserError
from kvroute.tokenizer import Tokenizer
from loadtest.bench import Arrivals, Target, with_answers
from loadtest.bench_stats import (
    SLO,
    Objectives,
    RequestRecord,
    format_summary,
    jain_index,
    percentiles,
    queue_lost_hits,
    summarize,
)
from loadtest.compare import VIEW_SEEDS, parse_entries, routing_flow_settings, sim_costs, view_draw, view_refresh_s
from loadtest.render import (
    CHAT_ANSWER_TOKENS,
    CHAT_QUESTION_TOKENS,
    CHAT_SYSTEM_TOKENS,
    CHAT_THINK_MS,
    BenchRequest,
    RenderError,
    dump_jsonl,
    render,
    vocabulary,
)
from loadtest.traffic_mix import TenantKeys, TenantShare, TrafficMix, parse_band_slos, parse_bands, parse_tenants
from sim.replay import ReplayConfig
from sim.sweep import main as sweep_main
from sim.sweep import parse_axes, sweep
from sim.workloads import generate

# -- statistics ---------------------------------------------------------------------------------------

SAMPLE_S = [0.512, 0.034, 0.078, 0.250, 1.731, 0.092, 0.120, 0.047, 0.300, 0.066, 0.081, 2.405, 0.150]


def record(index: int, ttft: float, e2e: float, tokens: int, itl: list[float] | None = None, **kw) -> RequestRecord:
    return RequestRecord(index, 0.0, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, itl_s=itl or [], **kw)


def test_percentiles_are_numpys_linear_interpolation():
    stats = percentiles(SAMPLE_S)
    ms = np.asarray(SAMPLE_S) * 1e3
    for p in (50, 90, 99):
        assert stats[f"p{p}"] == pytest.approx(np.percentile(ms, p, method="linear"), rel=1e-12)
    assert stats["mean"] == pytest.approx(ms.mean())
    # Worked by hand: 4 samples, p50 halfway between the 2nd and 3rd, p90 at rank 2.7, p99 at rank 2.97.
    assert percentiles([0.010, 0.020, 0.030, 0.040]) == pytest.approx(
        {"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": 39.7}
    )
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_decode_time_over_output_tokens_after_the_first():
    assert record(0, 0.1, 1.0, 10).tpot_s == pytest.approx(0.1)  # (1.0 - 0.1) / 9
    assert record(0, 0.1, 0.1, 1).tpot_s is None  # one token: no TPOT, as in vLLM
    assert RequestRecord(0, 0.0, status="http_503").tpot_s is None


def test_summary_pools_itl_over_requests_and_counts_tokens_and_workers():
    records = [
        record(0, 0.100, 0.400, 4, [0.1, 0.1, 0.1], prompt_tokens=1000, cached_tokens=0, worker="w0"),
        record(1, 0.050, 0.250, 3, [0.05, 0.15], prompt_tokens=1000, cached_tokens=992, worker="w1"),
        record(2, 0.070, 0.070, 1, prompt_tokens=500, cached_tokens=496, worker="w1"),
        RequestRecord(3, 0.5, status="http_429", error="too many requests"),
        RequestRecord(4, 0.6, status="stream_error"),
        RequestRecord(5, 0.7, status="http_429"),
    ]
    summary = summarize(records, duration_s=2.0)
    assert (summary.requests, summary.completed) == (6, 3)
    assert summary.itl_ms["p50"] == pytest.approx(np.percentile([100, 100, 100, 50, 150], 50))
    assert summary.ttft_ms["p90"] == pytest.approx(np.percentile([100, 50, 70], 90))
    assert summary.tpot_ms["p50"] == pytest.approx(np.percentile([100, 100], 50))  # the 1-token request has none
    assert summary.errors == {"http_429": 2, "stream_error": 1}
    assert summary.cached_token_share == pytest.approx((992 + 496) / 2500)
    assert summary.per_worker_requests == {"w0": 1, "w1": 2}
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.output_throughput == pytest.approx(4.0)
    assert summary.goodput == pytest.approx(3 / 6)  # no SLO: every completed request counts
    assert "http_429: 2" in format_summary(summary)
    assert json.loads(json.dumps(summary.to_json()))["errors"] == {"http_429": 2, "stream_error": 1}


def test_goodput_is_the_share_of_all_requests_within_every_slo():
    rng = np.random.default_rng(7)
    ttft = rng.lognormal(np.log(0.2), 0.8, 200)
    tokens = rng.integers(1, 60, 200)
    e2e = ttft + rng.lognormal(np.log(0.03), 0.4, 200) * np.maximum(tokens - 1, 0)
    records = [record(i, float(t), float(e), int(n)) for i, (t, e, n) in enumerate(zip(ttft, e2e, tokens, strict=True))]
    records += [RequestRecord(200 + i, 0.0, status="timeout") for i in range(10)]
    slo = SLO(ttft_ms=300, tpot_ms=40)
    tpot = np.where(tokens > 1, (e2e - ttft) / np.maximum(tokens - 1, 1), 0.0)
    expected = int(np.sum((ttft * 1e3 <= 300) & (tpot * 1e3 <= 40)))
    summary = summarize(records, duration_s=10.0, objectives=Objectives(slo))
    assert 0 < expected < 200
    assert summary.goodput == pytest.approx(expected / 210)
    assert summary.goodput_rps == pytest.approx(expected / 10.0)
    assert summary.to_json()["slo_ms"] == {"ttft": 300, "tpot": 40}


def test_slo_rejects_a_non_positive_objective_naming_it():
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError, match="tpot_ms"):
        SLO(tpot_ms=float("nan"))


def test_each_band_is_held_to_its_own_slo_and_each_tenant_to_its_weight():
    """Worked by hand: interactive (TTFT <= 1 s) meets 1 of 2, batch (the default: none) its completed one and
    not its 503; tenant a served 3,000 tokens at weight 2, b 1,000 at weight 1: x = (1,500, 1,000), Jain =
    2,500^2 / (2 * (1,500^2 + 1,000^2)) = 0.9615."""

    def sent(i: int, ttft: float, band: str, tenant: str, prompt: int = 900, **kw) -> RequestRecord:
        return record(i, ttft, ttft + 1.0, 100, prompt_tokens=prompt, band=band, tenant=tenant, **kw)

    records = [
        sent(0, 0.4, "interactive", "a", 1900),
        sent(1, 1.5, "interactive", "b"),
        sent(2, 3.0, "batch", "a"),
        RequestRecord(3, 0.0, status="http_503", band="batch", tenant="b"),
    ]
    objectives = Objectives(SLO(), {"interactive": SLO(ttft_ms=1000), "batch": SLO()}, {"a": 2.0})
    summary = summarize(records, 10.0, objectives)
    assert summary.goodput == pytest.approx(2 / 4)
    assert summary.per_band["interactive"] == {
        "requests": 2,
        "completed": 2,
        "goodput": 0.5,
        "ttft_ms": {"p50": pytest.approx(950.0), "p99": pytest.approx(1489.0)},
        "slo_ms": {"ttft": 1000},
    }
    assert summary.per_band["batch"]["goodput"] == 0.5 and summary.per_band["batch"]["slo_ms"] == {}
    assert summary.per_tenant["a"] == {
        "requests": 2,
        "completed": 2,
        "goodput": 1.0,
        "served_tokens": 2000 + 1000,
        "weight": 2.0,
    }
    assert summary.per_tenant["b"]["served_tokens"] == 1000 and summary.per_tenant["b"]["weight"] == 1.0
    assert summary.fairness == pytest.approx(2500**2 / (2 * (1500**2 + 1000**2)))
    assert jain_index([5.0, 5.0]) == 1.0 and jain_index([1.0, 0.0]) == 0.5 and jain_index([3.0]) is None
    report = json.loads(json.dumps(summary.to_json()))
    assert set(report["per_band"]) == {"interactive", "batch"} and report["fairness"] == pytest.approx(0.961538)
    text = format_summary(summary)
    assert "band interactive" in text and "tenant a" in text and "fairness             0.962" in text


def test_a_hit_whose_blocks_were_gone_at_admission_was_lost_in_the_queue():
    """Of our gateway's `hit`s, those that found fewer blocks cached when admitted than the pick matched; the
    match is capped at the blocks a prompt may reuse (all but its last token: 160 tokens reuse 9 of 10)."""

    def routed(i: int, reason: str, matched: int, cached: int, prompt: int = 400, **kw) -> RequestRecord:
        route = f"policy=kv_aware; reason={reason}; matched_blocks={matched}; attempts=1"
        return record(i, 0.1, 0.5, 10, prompt_tokens=prompt, cached_tokens=cached, route=route, **kw)

    records = [
        routed(0, "hit", 20, 320),  # found all 20
        routed(1, "hit", 20, 160),  # found 10: lost
        routed(2, "hit", 10, 144, prompt=160),  # matched 10, may reuse 9, found 9
        routed(3, "ring", 0, 0),  # not a hit
        routed(4, "hit", 5, 0, status="timeout"),  # no admission seen
    ]
    assert queue_lost_hits(records) == {"hits": 3, "lost": 1, "share": pytest.approx(1 / 3)}
    assert queue_lost_hits([record(0, 0.1, 0.5, 10)]) is None  # no route: a peer router
    assert "hits lost in queue   1 of 3 prefix hits (33.3%)" in format_summary(summarize(records, 1.0))


def test_a_traffic_mix_deals_conversations_to_tenants_and_requests_to_bands():
    mix = TrafficMix(parse_tenants("a:4,b:1"), parse_bands("interactive=0:0.2,batch=1:0.8"))
    workload = render("chat", 80, seed=3, think_ms=0)
    mixed = mix.apply(workload, seed=3)
    assert mixed.requests == mix.apply(workload, seed=3).requests != mix.apply(workload, seed=4).requests
    sessions: dict[str, set] = {}
    for request in mixed.requests:
        sessions.setdefault(request.session, set()).add(request.tenant)
    assert all(len(tenants) == 1 for tenants in sessions.values())  # one tenant per conversation
    dealt = [tenants.pop() for tenants in sessions.values()]
    assert dealt.count("a") == 4 * dealt.count("b") and len(dealt) == 10
    bands = [(r.band, r.priority) for r in mixed.requests]
    assert bands.count(("interactive", 0)) == 16 and bands.count(("batch", 1)) == 64
    assert [dataclasses.replace(r, tenant=None, band=None, priority=None) for r in mixed.requests] == list(
        workload.requests
    )
    assert mix.smg_classes() == {"interactive": "interactive", "batch": "bulk"}
    # What goes on the wire: the band's priority in the body; our gateway gets the tenant's key, a peer its salt.
    request = next(r for r in mixed.requests if r.tenant == "b" and r.band == "interactive")
    ours = Target("http://gw", "sim", tenant_keys={"a": "key-a", "b": "key-b"})
    assert ours.body(request)["priority"] == 0 and "cache_salt" not in ours.body(request)
    assert ours.headers(request)["authorization"] == "Bearer key-b"
    peer = Target(
        "http://smg", "sim", salt_by_tenant=True, band_headers={"interactive": {"x-smg-priority": "interactive"}}
    )
    assert peer.body(request)["cache_salt"] == "b" and "authorization" not in peer.headers(request)
    assert peer.headers(request)["x-smg-priority"] == "interactive"
    assert "priority" not in Target("http://gw", "sim").body(workload.requests[0])


def test_traffic_mix_flags_are_checked_naming_the_fault():
    assert parse_tenants("a:4:2, b:1") == (TenantShare("a", 4.0, 2.0), TenantShare("b", 1.0, 1.0))
    bands = parse_bands("interactive=0:0.2,batch=1:0.8")
    slos = parse_band_slos(["interactive:ttft=1,e2e=30"], bands, SLO(tpot_ms=50))
    assert slos == {"interactive": SLO(1000.0, 50, 30000.0), "batch": SLO(tpot_ms=50)}
    for call, message in (
        (lambda: parse_tenants("a"), "not NAME:SHARE"),
        (lambda: parse_tenants("a:x"), "a's share must be a number"),
        (lambda: parse_tenants("a:1:0"), "a's weight must be > 0"),
        (lambda: parse_tenants("a:1,a:2"), "listed twice"),
        (lambda: parse_bands("batch=low:1"), "batch's priority must be an integer"),
        (lambda: parse_bands("batch=1"), "not NAME=PRIORITY:SHARE"),
        (lambda: parse_band_slos(["bulk:ttft=1"], bands, SLO()), "unknown band 'bulk'"),
        (lambda: parse_band_slos(["batch:p99=1"], bands, SLO()), "give ttft=S"),
        (lambda: parse_band_slos(["batch:ttft=-1"], bands, SLO()), "batch's ttft must be > 0"),
    ):
        with pytest.raises(UserError, match=message):
            call()


def test_the_bench_keys_file_is_one_the_gateway_reads_with_each_tenants_salt(tmp_path):
    keys = TenantKeys.write(parse_tenants("a:4,b:1"), tmp_path)
    authenticator = Authenticator.from_config(str(keys.api_keys_file), keys.gateway_env())
    assert {authenticator.authenticate(keys.keys[name]).name for name in ("a", "b")} == {"a", "b"}
    assert {name: authenticator.authenticate(key).cache_salt for name, key in keys.keys.items()} == keys.salts()
    assert keys.api_keys_file.stat().st_mode & 0o077 == 0 and keys.secret_file.stat().st_mode & 0o077 == 0
    (tmp_path / "weighted").mkdir()
    weighted = TenantKeys.write(parse_tenants("a:4:3,b:1"), tmp_path / "weighted")
    assert [e.get("weight") for e in json.loads(weighted.api_keys_file.read_text())] == [3.0, None]


# -- workloads rendered to text --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return vocabulary("smollm2").tokenizer  # SmolLM2's, loaded once for the rendering and the checks


def test_each_token_id_renders_to_one_token_and_equal_prefixes_stay_equal(tokenizer):
    vocab = vocabulary("smollm2")
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 32_000, 700).tolist()
    a, b = shared + rng.integers(1, 32_000, 90).tolist(), shared + rng.integers(1, 32_000, 50).tolist()
    text_a, text_b = vocab.text(a), vocab.text(b)
    ids_a, ids_b = tokenizer.encode(text_a), tokenizer.encode(text_b)
    assert (len(ids_a), len(ids_b)) == (790, 750)
    assert text_a.startswith(vocab.text(shared)) and text_b.startswith(vocab.text(shared))
    assert ids_a[:700] == ids_b[:700] == tokenizer.encode(vocab.text(shared))
    assert ids_a[700] != ids_b[700]


def test_chat_sessions_share_the_system_prompt_and_grow_turn_by_turn(tokenizer):
    workload = render("chat", 40, seed=3)
    requests = workload.requests
    assert len(requests) == 40 and all(r.endpoint == "/v1/chat/completions" for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 5  # 8 turns each
    for turns in by_session.values():
        assert turns[0].after is None
        assert [t.after for t in turns[1:]] == [t.index for t in turns[:-1]]
        for k, turn in enumerate(turns):
            assert [m["role"] for m in turn.messages] == ["system"] + ["user", "assistant"] * k + ["user"]
            assert turn.max_tokens == CHAT_ANSWER_TOKENS
    first, second = by_session["chat-0"][:2]
    assert second.messages[: len(first.messages)] == first.messages
    text_1 = tokenizer.apply_chat_template(list(first.messages))
    text_2 = tokenizer.apply_chat_template(list(second.messages))
    ids_1, ids_2 = tokenizer.encode(text_1), tokenizer.encode(text_2)
    template_tokens = len(ids_1) - CHAT_SYSTEM_TOKENS - CHAT_QUESTION_TOKENS
    assert 0 < template_tokens < 20
    assert ids_2[: len(ids_1) - 3] == ids_1[:-3]  # all but the generation prompt's "<|im_start|>assistant\n"
    assert len({r.messages[0]["content"] for r in requests}) == 1
    # The replay's token-id trace of the same turns: prompt = history + question, the logged answer after it.
    trace = workload.trace.requests
    assert [t.input_length for t in trace if t.session_id == "chat-0"][:3] == [1100, 1500, 1900]


def test_chat_think_times_are_seeded_exponential_and_leave_the_tokens_alone():
    requests = render("chat", 256, seed=3).requests
    thinks = np.asarray([r.think_s for r in requests])
    assert thinks.min() > 0 and thinks.mean() == pytest.approx(CHAT_THINK_MS / 1e3, rel=0.2)
    assert [r.think_s for r in render("chat", 256, seed=3).requests] == thinks.tolist()
    quick = render("chat", 256, seed=3, think_ms=0).requests
    assert {r.think_s for r in quick} == {0.0}
    assert [r.messages for r in quick] == [r.messages for r in requests]
    with pytest.raises(RenderError, match="think time"):
        render("chat", 8, think_ms=-1)


def test_sim_answers_are_single_token_words_that_round_trip_through_the_chat_template(tokenizer):
    """A sim worker's answer, detokenized and sent back as the next turn's assistant message, tokenizes to the
    ids it decoded: the prompt, then exactly those ids, so the blocks they filled on its worker are a hit."""
    from worker.config import EngineConfig
    from worker.sim_runner import SimRunner
    from worker.sim_words import single_token_words

    first = render("chat", 1, seed=4, think_ms=0).requests[0]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(list(first.messages)))

    def answer(seed: int) -> list[int]:
        runner = SimRunner(EngineConfig(model="sim", seed=seed), tokenizer=tokenizer)
        context = list(prompt)
        for _ in range(CHAT_ANSWER_TOKENS):
            context.append(runner.next_token(context[-1], len(context)))
        return context[len(prompt) :]

    ids = answer(seed=0)
    assert ids == answer(seed=0) != answer(seed=1)
    assert set(ids) <= {w.token_id for w in single_token_words(tokenizer)} and len(set(ids)) > 250
    text = tokenizer.decode(ids)
    messages = [*first.messages, {"role": "assistant", "content": text}, {"role": "user", "content": " next"}]
    again = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert again[: len(prompt) + len(ids)] == prompt + ids


def test_synthetic_conversations_follow_their_previous_turn_and_others_do_not():
    multiturn = render("multiturn", 12).requests
    assert multiturn[0].endpoint == "/v1/completions"
    followers = [r for r in multiturn if r.after is not None]
    assert len(followers) == 12 - 2  # two chats of six turns
    assert all(multiturn[r.after].session == r.session for r in followers)
    assert all(multiturn[r.after].prompt and r.prompt.startswith(multiturn[r.after].prompt) for r in followers)
    assert all(r.after is None for r in render("support", 10).requests)
    tenants = render("tenants", 8).requests
    assert {r.cache_salt for r in tenants} == {f"tenant-{i}" for i in range(4)}


def test_a_mooncake_trace_renders_equal_hash_ids_to_equal_text(tmp_path, tokenizer):
    lines = [
        {"timestamp": 0, "input_length": 1200, "output_length": 64, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 4]},
        {"timestamp": 900, "input_length": 300, "output_length": 1, "hash_ids": [5]},
    ]
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(line) for line in lines))
    full = render(f"trace:{path}").requests
    assert [len(tokenizer.encode(r.prompt)) for r in full] == [1200, 1100, 300]
    assert full[0].prompt[:200] == full[1].prompt[:200]
    ids_0, ids_1 = tokenizer.encode(full[0].prompt), tokenizer.encode(full[1].prompt)
    assert ids_0[:1024] == ids_1[:1024] and ids_0[1024:1030] != ids_1[1024:1030]
    assert [r.max_tokens for r in full] == [64, 10, 1]
    assert [r.arrival_s for r in full] == [0.0, 0.5, 0.9]
    scaled = render(f"trace:{path}", block_tokens=32).requests  # 16x smaller
    assert [len(tokenizer.encode(r.prompt)) for r in scaled] == [75, 69, 19]
    assert [r.max_tokens for r in scaled] == [4, 1, 1]
    assert tokenizer.encode(scaled[0].prompt)[:64] == tokenizer.encode(scaled[1].prompt)[:64]


def test_the_dump_is_the_prefix_doctors_input(tmp_path):
    from sim.doctor import read_prompts

    path = tmp_path / "chat.jsonl"
    dump_jsonl(render("chat", 8), path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(line) for line in lines[:1]] == [{"app", "messages", "timestamp", "session", "max_tokens"}]
    assert len(read_prompts(path, vocabulary("smollm2").tokenizer)) == 8


def test_bad_workloads_are_named():
    with pytest.raises(RenderError, match="nope"):
        render("nope")
    with pytest.raises(RenderError, match="requests must be >= 1"):
        render("chat", 0)
    with pytest.raises(RenderError, match="no such file"):
        render("trace:/nonexistent.jsonl")
    with pytest.raises(RenderError, match="block_tokens"):
        render("trace:/nonexistent.jsonl", block_tokens=0)


# -- the generator's arrivals and live chat history ---------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    requests = tuple(BenchRequest(i, i / 10, 1, prompt=" probe") for i in range(2000))
    times = Arrivals(rate=8.0, seed=1).send_times(requests)
    assert times == Arrivals(rate=8.0, seed=1).send_times(requests) != Arrivals(rate=8.0, seed=2).send_times(requests)
    assert times[0] == 0.0 and np.mean(np.diff(times)) == pytest.approx(1 / 8.0, rel=0.05)
    assert Arrivals(concurrency=4).send_times(requests) is None
    assert Arrivals(time_scale=0.5).send_times(requests)[5] == pytest.approx(requests[5].arrival_s / 2)
    with pytest.raises(ValueError, match="rate"):
        Arrivals(rate=-1.0)
    with pytest.raises(ValueError, match="not both"):
        Arrivals(rate=1.0, concurrency=2)


def test_live_history_puts_the_servers_answers_in_the_later_turns():
    requests = render("chat", 16, seed=5).requests
    session = [r for r in requests if r.session == "chat-1"]
    answers = {session[0].index: "first answer", session[1].index: "second answer"}
    third = with_answers(session[2], requests, answers)
    assert [m["content"] for m in third.messages if m["role"] == "assistant"] == ["first answer", "second answer"]
    assert [m for m in third.messages if m["role"] != "assistant"] == [
        m for m in session[2].messages if m["role"] != "assistant"
    ]
    del answers[session[1].index]  # a failed turn keeps its logged answer
    kept = with_answers(session[2], requests, answers).messages
    assert kept[2]["content"] == "first answer" and kept[4] == session[2].messages[4]


# -- compare: real sim workers, our gateway and a peer router ----------------------------------------------


def test_compare_entries_are_checked_before_any_fleet_starts():
    assert [e.name for e in parse_entries("kv_aware, smg:cache_aware,vllm-router:round_robin")] == [
        "kv_aware",
        "smg:cache_aware",
        "vllm-router:round_robin",
    ]
    entries = parse_entries("kv_aware,kv_aware@vllm,round_robin@grpc,kv_aware+flow-off,kv_aware@vllm+flow-off")
    assert [(e.name, e.mode, e.flow_control) for e in entries] == [
        ("kv_aware", "grpc", True),
        ("kv_aware@vllm", "vllm", True),
        ("round_robin", "grpc", True),
        ("kv_aware+flow-off", "grpc", False),
        ("kv_aware@vllm+flow-off", "vllm", False),
    ]
    tiered = parse_entries(
        "kv_aware+host-kv-blocks=3000,kv_aware+flow-off+host-kv-blocks=8,smg:cache_aware+host-kv-blocks=5"
    )
    assert [(e.name, e.flow_control, e.host_kv_blocks) for e in tiered] == [
        ("kv_aware+host-kv-blocks=3000", True, 3000),
        ("kv_aware+flow-off+host-kv-blocks=8", False, 8),
        ("smg:cache_aware+host-kv-blocks=5", True, 5),
    ]
    for bad, message in (
        ("kv_aware+host-kv-blocks=0", "unknown option 'host-kv-blocks=0'"),
        ("kv_aware+host-kv-blocks=many", "unknown option"),
        ("nginx:rr", "unknown router 'nginx'"),
        ("fastest", "unknown kvroute policy 'fastest'"),
        ("smg:", "names no policy"),
        ("prefix,prefix", "listed twice"),
        ("kv_aware,kv_aware@grpc", "listed twice"),
        ("kv_aware@sglang", "unknown worker mode 'sglang'"),
        ("smg:cache_aware@vllm", "smg reaches the workers over HTTP only"),
        ("kv_aware+flow-on", "unknown option 'flow-on'"),
        ("smg:cache_aware+flow-off", "smg has no flow control"),
        ("kv_aware+flow-off,kv_aware@grpc+flow-off", "listed twice"),
        (" , ", "no entries"),
    ):
        with pytest.raises(UserError, match=message):
            parse_entries(bad)


def test_a_short_compare_run_reports_every_router_and_worker_mode_alike(tmp_path):
    """Three fresh fleets of one sim worker in one run: `kv_aware`, smg's `cache_aware` over the worker's HTTP
    port, and `kv_aware@vllm` over a worker that publishes its KV events in vLLM's wire format and is named
    `vllm://` (the gateway routes from its ZMQ events and forwards over its HTTP front door). The same 3
    closed-loop chat turns with think times, in two priority bands; figures from the workers' own counters. Most
    of its time is the workers' start (torch import, tokenizer), so it sends few requests and few overhead
    probes."""
    out = tmp_path / "compare.json"
    entries = ("kv_aware", "smg:cache_aware", "kv_aware@vllm")
    argv = [
        sys.executable, "-m", "launch.cli", "bench", "--compare", ",".join(entries),
        "--workers", "1", "--model", "sim", "--workload", "chat", "--requests", "3", "--concurrency", "2",
        "--probes", "2", "--worker-arg=--sim-decode-ms-per-step=1", "--think-ms", "100", "--no-progress",
        "--bands", "interactive=0:1,batch=1:2", "--band-slo", "interactive:ttft=60", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == set(entries), done.stderr[-3000:]
    assert done.returncode == 0 and report["skipped"] == {}
    assert runs["kv_aware"]["worker_mode"] == "grpc" and runs["kv_aware@vllm"]["worker_mode"] == "vllm"
    for name, run in runs.items():
        assert run["errors"] == {} and run["completed"] == 3, name
        assert set(run["ttft_ms"]) == {"p50", "p90", "p99"} and run["ttft_ms"]["p50"] > 0
        assert run["e2e_ms"]["p99"] >= run["ttft_ms"]["p99"]
        assert run["per_worker_requests"] == {"w0": 3}  # the workers' own counters, by their ids
        # 3 turns of one session, 1,114 to 1,900 prompt tokens: the system prompt and every earlier turn are
        # reused wherever the router keeps the session on its worker.
        assert run["prompt_tokens"] > 3 * 1100 and 0 < run["prefill_tokens"] < run["prompt_tokens"]
        assert 0 < run["cached_token_share"] < 1 and run["goodput"] == 1.0
        assert set(run["router_overhead_ms"]) >= {"p50", "p99"}
        # Every router took each band's `priority` in the body (smg also its class as x-smg-priority, its
        # priority scheduler on): one interactive request and two batch, each band with its own objectives.
        bands = run["per_band"]
        assert {b: (v["requests"], v["goodput"], v["slo_ms"]) for b, v in bands.items()} == {
            "interactive": (1, 1.0, {"ttft": 60000.0}),
            "batch": (2, 1.0, {}),
        }, name
        assert bands["interactive"]["ttft_ms"]["p50"] > 0 and "per_tenant" not in run
        assert run["completed_tokens_per_s"] > 0 and run["preemptions"] == 0
    # Our gateway says which requests it routed as a hit and with how many blocks (x-kvroute-route): none of them
    # found fewer at admission on an idle worker. A peer's routing is not known: no figure.
    for name in ("kv_aware", "kv_aware@vllm"):
        assert runs[name]["queue_lost_hits"]["lost"] == 0 and runs[name]["queue_lost_hits"]["hits"] >= 1, name
    assert runs["smg:cache_aware"]["queue_lost_hits"] is None
    # Closed loop: each turn carries the answer its worker streamed (sim answers depend on the context and the
    # seed only, so every fleet gets the same prompts) and that worker cached it as it decoded, so the session
    # prefills only the new question: exactly the ideal, as the replay predicts, whether the gateway's index was
    # read over gRPC or built from ZMQ events.
    ideal = runs["kv_aware"]["replay_prediction"]["ideal_prefill_tokens"]
    assert ideal < 1200 + 2 * 150  # the first turn, then ~110 new tokens a turn
    for name in ("kv_aware", "kv_aware@vllm"):
        prediction = runs[name]["replay_prediction"]
        assert runs[name]["prefill_tokens"] == prediction["prefill_tokens"] == prediction["ideal_prefill_tokens"]
        assert runs[name]["prompt_tokens"] == runs["smg:cache_aware"]["prompt_tokens"], name
    assert runs["smg:cache_aware"]["prefill_tokens"] == ideal
    # Each request's route as the gateway said it (x-kvroute-route) and as the prediction picked it, to line up.
    for name in ("kv_aware", "kv_aware@vllm"):
        assert all(r["route"].startswith("policy=kv_aware; reason=") for r in runs[name]["per_request"]), name
        predicted = runs[name]["replay_prediction"]["per_request"]
        assert all(p["reason"] in ("hit", "ring", "idle") and p["matched_blocks"] >= 0 for p in predicted), name
    assert all("route" not in r for r in runs["smg:cache_aware"]["per_request"])
    assert "replay_prediction" not in runs["smg:cache_aware"]
    # Each turn went out its think time after the previous one finished.
    think = {r.index: r.think_s for r in render("chat", 3, think_ms=100).requests}
    after = {r.index: r.after for r in render("chat", 3, think_ms=100).requests}
    for run in runs.values():
        sent = {r["index"]: r for r in run["per_request"]}
        for index, previous in after.items():
            if previous is not None:
                finish = sent[previous]["sent_ms"] + sent[previous]["e2e_ms"]
                assert sent[index]["sent_ms"] >= finish + think[index] * 1e3 - 0.01
    # The prediction reads each worker as often as the live gateway did (its measured report intervals, drawn
    # per poller): the median of VIEW_SEEDS draws. The vLLM-mode gateway polls nothing: the poll interval.
    refresh = runs["kv_aware"]["gateway"]["report_interval_ms_mean"]
    assert refresh >= 100.0 and runs["kv_aware"]["gateway"]["reasons"]
    prediction = runs["kv_aware"]["replay_prediction"]
    assert prediction["view_refresh_ms"] == refresh and prediction["view_seeds"] == VIEW_SEEDS
    per_seed = prediction["ttft_ms_p50_per_seed"]
    assert per_seed == sorted(per_seed) and per_seed[VIEW_SEEDS // 2] == prediction["ttft_ms"]["p50"]
    assert runs["kv_aware@vllm"]["replay_prediction"]["view_refresh_ms"] == 100.0
    assert runs["kv_aware@vllm"]["replay_prediction"]["view_seeds"] == 1
    assert all(name in done.stdout for name in entries)  # the side-by-side table
    assert "interactive goodput" in done.stdout and "hits lost in queue" in done.stdout
    assert "kv_aware@vllm / kv_aware: prefill x1.000, TTFT p50 x" in done.stdout


def test_a_short_run_of_two_tenants_reports_each_tenants_share_and_the_fairness(tmp_path):
    """Two tenants, each with its own API key in the gateway's keys file (a request without one would get 401),
    two sessions each of the `tenants` workload, open-loop: each tenant's goodput and served tokens, Jain's
    index over them, and the replay over the tenants' own salts predicting the live prefill; with flow control
    (the default) and without (`+flow-off`)."""
    entries = ("kv_aware", "kv_aware+flow-off")
    out = tmp_path / "mix.json"
    argv = [
        sys.executable, "-m", "launch.cli", "bench", "--compare", ",".join(entries),
        "--workers", "1", "--model", "sim", "--workload", "tenants", "--requests", "8", "--rate", "20",
        "--probes", "2", "--worker-arg=--sim-decode-ms-per-step=1", "--no-progress",
        "--tenants", "a:1,b:1", "--bands", "interactive=0:1,batch=1:1", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == set(entries) and done.returncode == 0, done.stderr[-3000:]
    for name, run in runs.items():
        assert run["errors"] == {} and run["completed"] == 8, name
        tenants = run["per_tenant"]
        assert {t: (v["requests"], v["goodput"], v["weight"]) for t, v in tenants.items()} == {
            "a": (4, 1.0, 1.0),
            "b": (4, 1.0, 1.0),
        }
        served = [v["served_tokens"] for v in tenants.values()]
        assert sum(served) == run["prompt_tokens"] + sum(r["output_tokens"] for r in run["per_request"])
        assert run["fairness"] == pytest.approx(sum(served) ** 2 / (2 * sum(x * x for x in served)), abs=1e-6)
        assert {b: v["requests"] for b, v in run["per_band"].items()} == {"interactive": 4, "batch": 4}
        assert {(r["tenant"], r["band"]) for r in run["per_request"]} <= {(t, b) for t in "ab" for b in run["per_band"]}
        # Open loop: a session's requests may overlap, and which of two caches its blocks first is the run's
        # timing, so the replay over the tenants' salts comes close, not to the token (8 requests: one turn's
        # blocks moved it 17% once).
        assert run["replay_prediction"]["prefill_tokens"] == pytest.approx(run["prefill_tokens"], rel=0.25), name
        # The replay runs the gateway's flow control when the run's gateway had it, and judges its requests by
        # the run's objectives per band, as the bench does the live ones.
        prediction = run["replay_prediction"]
        assert prediction["flow_control"] == (name == "kv_aware") and prediction["sheds"] == {}
        assert {b: v["goodput"] for b, v in prediction["per_band"].items()} == {"interactive": 1.0, "batch": 1.0}
    assert "tenant a goodput" in done.stdout and "fairness (Jain)" in done.stdout
    assert "replay interactive goodput" in done.stdout


def test_the_prediction_draws_the_live_gateways_report_intervals_from_its_histogram():
    buckets = {"0.05": 0, "0.1": 0, "0.105": 90, "0.11": 90, "0.2": 99, "+Inf": 100}
    run = SimpleNamespace(gateway={"report_interval_ms_mean": 104.0, "report_interval_buckets": buckets})
    assert view_draw(run) == ((0.1, 0.105, 90.0), (0.11, 0.2, 9.0), (0.2, 0.2, 1.0))
    assert view_refresh_s(run) == pytest.approx(0.104)
    assert view_draw(SimpleNamespace(gateway={})) == () and view_refresh_s(SimpleNamespace(gateway={})) == 0.1


def test_the_prediction_uses_the_sim_workers_cost_model():
    args = ("--sim-prefill-us-per-token=100", "--seed", "3", "--sim-decode-ms-per-step", "5")
    assert sim_costs(args) == {"prefill_us_per_token": 100.0, "decode_ms_per_step": 5.0}
    assert sim_costs(()) == {}
    with pytest.raises(UserError, match="--sim-decode-ms-per-step needs a number"):
        sim_costs(("--sim-decode-ms-per-step",))


def test_the_prediction_reads_flow_control_from_the_gateways_routing_config(tmp_path):
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"flow_control": {"max_worker_waiting": 3, "bands": {"0": {"max_wait_s": 2}}}}))
    for args in (("--routing-config", str(routing)), (f"--routing-config={routing}", "--drain-timeout", "5")):
        settings = routing_flow_settings(args)
        assert settings.max_worker_waiting == 3 and settings.band(0).max_wait_s == 2
    assert routing_flow_settings(("--drain-timeout", "5")) == FlowControlConfig()


# -- capacity sweep -----------------------------------------------------------------------------------


def test_sweep_axes_are_checked_and_an_unswept_axis_keeps_its_single_value():
    assert parse_axes(["replicas=8,2,4,4"], 4, 1000) == ([2, 4, 8], [1000], [0])
    assert parse_axes(["capacity-blocks=500", "replicas=2"], 4, 1000) == ([2], [500], [0])
    assert parse_axes(["host-kv-blocks=3000,0"], 4, 1000) == ([4], [1000], [0, 3000])
    for bad, message in (
        (["nodes=2"], "AXIS one of replicas, capacity-blocks"),
        (["replicas"], "expected AXIS=V1"),
        (["replicas=2,x"], "must be integers"),
        (["replicas=0"], ">= 1"),
        (["replicas=2", "replicas=4"], "given twice"),
        (["replicas=" + ",".join(map(str, range(1, 10))), "capacity-blocks=" + ",".join(map(str, range(1, 9)))],
         "72 grid points"),
    ):  # fmt: skip
        with pytest.raises(UserError, match=message):
            parse_axes(bad, 4, 1000)


def test_the_sweep_replays_every_point_against_one_ideal(tmp_path):
    trace = generate("multiturn", 100, seed=0)  # 100 conversations show every property 200 did, at 40% of the cost
    result = sweep(trace, ReplayConfig(policies=("round_robin", "kv_aware")), [2, 4], [300, 3000], 0.9, False)
    assert [(p.replicas, p.capacity_blocks) for p in result.points if p.policy == "kv_aware"] == [
        (2, 300), (2, 3000), (4, 300), (4, 3000),
    ]  # fmt: skip
    assert {p.policy for p in result.points} == {"round_robin", "kv_aware", "oracle"}
    assert 0 < result.ideal_prefill_tokens <= min(p.prefill_tokens for p in result.points)
    rr = {(p.replicas, p.capacity_blocks): p.hit_rate for p in result.points if p.policy == "round_robin"}
    assert rr[(2, 3000)] >= rr[(2, 300)] and rr[(4, 3000)] >= rr[(4, 300)]  # more cache keeps more
    best = result.smallest("kv_aware")
    assert best is None or best.hit_rate >= 0.9 * result.ideal_hit_rate
    out = tmp_path / "sweep.json"
    assert sweep_main(["synthetic:multiturn", "--requests", "60", "--sweep", "replicas=2,4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["points"]) == 2 * 4 and set(report["smallest"]) == {"round_robin", "prefix", "kv_aware", "oracle"}
    assert sweep_main(["synthetic:multiturn", "--sweep", "gpus=2"]) == 2  # a clear one-line error, no traceback


def test_the_sweep_prices_a_host_tier_in_prefill_saved(tmp_path, capsys):
    """`--sweep host-kv-blocks=0,N`: the same fleet with and without a host tier, one trace, one ideal; the tier
    only ever saves prefill, and the table and PNG say which rows have one."""
    trace = generate("multiturn", 60, seed=0)
    config = ReplayConfig(policies=("kv_aware",))
    result = sweep(trace, config, [2], [300], 0.9, False, hosts=[0, 3000])
    prefill = {p.host_kv_blocks: p.prefill_tokens for p in result.points if p.policy == "kv_aware"}
    assert prefill[3000] < prefill[0]
    png = tmp_path / "sweep.png"
    argv = ["synthetic:multiturn", "--requests", "60", "--replicas", "2", "--capacity-blocks", "300"]
    assert sweep_main([*argv, "--policies", "kv_aware", "--sweep", "host-kv-blocks=0,3000", "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "host blocks/replica" in table and "3,000" in table and png.stat().st_size > 0
    assert sweep_main([*argv, "--sweep", "host-kv-blocks=-1"]) == 2
