"""`kvroute bench`'s agent workload and the Responses API as its sender (issue 32): the sessions' shape and
token-id trace, the `/v1/responses` bodies a conversation's turns become, the continued turns' reuse, the
sender against a gateway over sim workers, and one short `--compare kv_aware,kv_aware+responses` over fleets
of sim worker processes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from functools import partial

import pytest
from gateway_stack import KEY, SERVED_MODEL, GatewayStack, StackOptions, stack_fixture

from gateway.admission.limits import Limits
from kvroute.errors import UserError
from loadtest.bench import Arrivals, HttpSender, Target, run_requests
from loadtest.bench_stats import RequestRecord, continued_reuse, summarize
from loadtest.compare import parse_entries
from loadtest.render import (
    AGENT_ANSWER_TOKENS,
    AGENT_TASK_TOKENS,
    AGENT_TOOL_OUTPUT_TOKENS,
    AGENT_TOOLS,
    AGENT_TURNS,
    TOOL_OUTPUT_LEAD,
    BenchRequest,
    render,
    vocabulary,
)

stack = stack_fixture(
    StackOptions(
        model="sim", workers=2, max_model_len=4096, num_kv_blocks=1024,
        limits=Limits(max_prompt_tokens=4000, max_tokens=256, max_body_bytes=256 * 1024, max_n=1),
    )
)  # fmt: skip


def test_agent_sessions_share_the_tool_schemas_and_append_tool_outputs():
    workload = render("agent", 14, seed=2, think_ms=0)
    vocab = vocabulary("smollm2")
    requests, trace = workload.requests, workload.trace.requests
    assert workload.name == "agent" and len(requests) == len(trace) == 14
    assert {r.endpoint for r in requests} == {"/v1/chat/completions"}
    system = requests[0].messages[0]["content"]
    assert {r.messages[0]["content"] for r in requests} == {system}  # one tool preamble for every session
    assert system.count(" function name ") == AGENT_TOOLS and len(system.split()) == 150 * AGENT_TOOLS
    by_session: dict[str, list[BenchRequest]] = {}
    for request in requests:
        by_session.setdefault(request.session or "", []).append(request)
    assert [len(turns) for turns in by_session.values()] == [AGENT_TURNS, AGENT_TURNS, 2]
    for turns in by_session.values():
        assert turns[0].after is None and [t.after for t in turns[1:]] == [t.index for t in turns[:-1]]
        for k, turn in enumerate(turns):
            roles = [m["role"] for m in turn.messages]
            assert roles == ["system", "user"] + ["assistant", "user"] * k and turn.max_tokens == AGENT_ANSWER_TOKENS
            if k:  # the previous turn's messages, its answer, then a tool's output
                assert turn.messages[: len(turns[k - 1].messages)] == turns[k - 1].messages
                assert turn.messages[-1]["content"].startswith(TOOL_OUTPUT_LEAD + " ")
                assert len(turn.messages[-1]["content"].split()) == AGENT_TOOL_OUTPUT_TOKENS
            else:
                assert len(turn.messages[1]["content"].split()) == AGENT_TASK_TOKENS
    # The replay's trace is the same conversation in ids: the prompt renders to the messages' texts, the
    # logged answer to the next turn's assistant message.
    for request, traced in zip(requests, trace, strict=True):
        assert vocab.text(traced.token_ids) == "".join(m["content"] for m in request.messages)
        assert traced.session_id == request.session and traced.output_length == AGENT_ANSWER_TOKENS
        follower = next((r for r in requests if r.after == request.index), None)
        if follower is not None:
            assert vocab.text(traced.output_token_ids) == follower.messages[len(request.messages)]["content"]
    assert [t.input_length for t in trace if t.session_id == "agent-0"] == [
        150 * AGENT_TOOLS + AGENT_TASK_TOKENS + k * (AGENT_ANSWER_TOKENS + AGENT_TOOL_OUTPUT_TOKENS)
        for k in range(AGENT_TURNS)
    ]


def test_a_conversation_through_the_responses_api_sends_only_the_new_turn_after_its_first():
    requests = render("agent", 8, seed=1, think_ms=0).requests
    first, second = [r for r in requests if r.session == "agent-0"][:2]
    target = Target("http://127.0.0.1:1", "sim", api="responses")
    assert target.path(second) == "/v1/responses" and Target("x", "sim").path(second) == "/v1/chat/completions"
    whole = target.body(second)  # no response id kept for the previous turn (it failed): the whole conversation
    assert whole["instructions"] == second.messages[0]["content"] and "previous_response_id" not in whole
    assert [(i["role"], i["content"]) for i in whole["input"]] == [
        (m["role"], m["content"]) for m in second.messages[1:]
    ]
    assert whole["max_output_tokens"] == AGENT_ANSWER_TOKENS and whole["stream"] and whole["temperature"] == 0
    continued = target.body(dataclasses.replace(second, previous_response_id="resp_1"))
    assert continued["previous_response_id"] == "resp_1" and continued["instructions"] == whole["instructions"]
    assert continued["input"] == [{"type": "message", "role": "user", "content": second.messages[-1]["content"]}]
    assert "previous_response_id" not in target.body(first) and len(target.body(first)["input"]) == 1
    assert target.body(BenchRequest(0, 0.0, 4, prompt=" some words"))["input"] == " some words"
    with pytest.raises(UserError, match="--exact-length"):
        Target("x", "sim", exact_length=True, api="responses")
    with pytest.raises(UserError, match="cache_salt"):
        target.body(BenchRequest(0, 0.0, 4, prompt=" a", cache_salt="t"))


def test_the_responses_sender_continues_each_turn_by_its_previous_response(stack: GatewayStack):
    """Two agent sessions through a gateway's /v1/responses: every turn completes; each later one names the
    response its previous turn got, goes to that turn's worker and finds all of the conversation so far
    cached; its prompt is the whole conversation, which the gateway rendered from the stored turns and the new
    tool output, all that was sent."""
    workload = render("agent", 12, seed=0, think_ms=0)
    target = Target(stack.http_url, SERVED_MODEL, KEY, api="responses")
    records, _ = asyncio.run(run_requests(workload, partial(HttpSender, target), Arrivals(concurrency=2), False))
    assert [r.status for r in records] == ["ok"] * 12, [r.error for r in records]
    by_index = {r.index: r for r in records}
    for request in workload.requests:
        record = by_index[request.index]
        assert record.response_id and record.response_id.startswith("resp_")
        if request.after is None:
            assert record.previous_response_id is None and record.cached_tokens < record.prompt_tokens
            continue
        previous = by_index[request.after]
        assert record.previous_response_id == previous.response_id
        assert "reason=conversation" in (record.route or "") and record.worker == previous.worker
        assert record.prompt_tokens > previous.prompt_tokens + previous.output_tokens + AGENT_TOOL_OUTPUT_TOKENS
    reuse = continued_reuse(records)
    assert reuse is not None and reuse["turns"] == 10 and reuse["min"] >= 0.95


def test_a_continued_turns_reuse_is_of_the_previous_prompt_and_output_in_whole_blocks():
    def turn(index: int, after: int | None, prompt: int, cached: int, status: str = "ok") -> RequestRecord:
        return RequestRecord(index, 0.0, status, e2e_s=1.0, prompt_tokens=prompt, cached_tokens=cached,
                             output_tokens=100, after=after)  # fmt: skip

    records = [
        turn(0, None, 1294, 0),
        turn(1, 0, 1605, 1392),  # (1294 + 100 - 1) // 16 * 16 = 1392: all of it
        turn(2, 1, 1916, 1600),  # of 1696: 94.3%
        turn(3, None, 1294, 0, status="http_503"),
        turn(4, 3, 1605, 0),  # its previous turn failed: not counted
    ]
    reuse = continued_reuse(records)
    assert reuse == {"target": 0.95, "turns": 2, "median": pytest.approx(0.971698, abs=1e-6),
                     "min": pytest.approx(1600 / 1696, abs=1e-6), "share_at_target": 0.5}  # fmt: skip
    assert summarize(records, 1.0).to_json()["continued_reuse"] == reuse
    assert continued_reuse(records[:1]) is None and "continued_reuse" not in summarize(records[:1], 1.0).to_json()


def test_responses_is_an_option_of_our_entries_only():
    entries = parse_entries("kv_aware,kv_aware+responses,prefix@vllm+flow-off+responses")
    assert [(e.name, e.api) for e in entries] == [
        ("kv_aware", "chat"),
        ("kv_aware+responses", "responses"),
        ("prefix@vllm+flow-off+responses", "responses"),
    ]
    with pytest.raises(UserError, match="for smg leave it out"):
        parse_entries("smg:cache_aware+responses")
    with pytest.raises(UserError, match="listed twice"):
        parse_entries("kv_aware+responses,kv_aware+responses")


def test_an_agent_run_through_the_responses_api_reuses_what_chat_does(tmp_path):
    """Two fleets of two sim workers, the same 24 agent turns (4 sessions of 6) sent as chat completions
    re-sending the history and through /v1/responses continuing the previous response: every turn completes,
    each continued turn names its previous turn's response and finds >= 95% of the conversation so far cached
    (whole blocks) on the worker that served it, and the responses run prefills no more than chat's."""
    out = tmp_path / "agent.json"
    argv = [
        sys.executable, "-m", "launch.cli", "bench", "--compare", "kv_aware,kv_aware+responses",
        "--workers", "2", "--model", "sim", "--workload", "agent", "--requests", "24", "--concurrency", "4",
        "--think-ms", "50", "--probes", "2", "--worker-arg=--sim-decode-ms-per-step=1", "--no-progress",
        "--no-predict", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.exists(), done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert done.returncode == 0 and set(runs) == {"kv_aware", "kv_aware+responses"}, done.stderr[-3000:]
    after = {r.index: r.after for r in render("agent", 24).requests}
    for name, run in runs.items():
        assert run["errors"] == {} and run["completed"] == 24, name
        reuse = run["continued_reuse"]
        assert reuse["turns"] == 20 and reuse["min"] >= 0.95 and reuse["share_at_target"] == 1.0, (name, reuse)
    chat, responses = runs["kv_aware"], runs["kv_aware+responses"]
    sent = {r["index"]: r for r in responses["per_request"]}
    for index, previous in after.items():
        if previous is None:
            assert "previous_response_id" not in sent[index]
        else:
            assert sent[index]["previous_response_id"] == sent[previous]["response_id"]
            assert "reason=conversation" in sent[index]["route"]
            assert sent[index]["worker"] == sent[previous]["worker"]
    assert all("response_id" not in r for r in chat["per_request"])
    assert responses["prefill_tokens"] <= 1.05 * chat["prefill_tokens"]
    assert "kv_aware+responses / kv_aware: prefill x" in done.stdout and "continued reuse p50" in done.stdout
