"""The OpenAI-compatible HTTP front door over the real request path and two real `sim` workers, through the
gateway's HTTP server on a real socket (tests/gateway_stack.py): every bad input gets its 4xx in OpenAI's error
shape naming the field (and the server keeps serving), response and stream shapes, include_usage, stop strings,
n, logprobs, headers, cache salts, and client disconnects cancelling the worker's request.

`sim` workers emit deterministic token ids (a function of the context), so the same prompt gives the same
text streamed or not, whatever the sampling parameters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_stack import KEY, SERVED_MODEL, SMALL_KEY, GatewayStack, StackOptions, stack_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.frontdoors.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)

AUTH = {"authorization": f"Bearer {KEY}"}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # over 64 tokens: several full blocks
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


stack = stack_fixture(StackOptions(model="sim", workers=2, dead_fleet=True))


@pytest.fixture(scope="module")
def client(stack: GatewayStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.http_url, headers=AUTH, timeout=30) as http:
        yield http


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, checking that it ends in `data: [DONE]`."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks), blocks
    assert blocks[-1] == "data: [DONE]", "a stream ends in [DONE]"
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    ErrorResponse.model_validate(body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert error["message"].startswith(f"{param}: "), "the message names the field"
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_routed(response: httpx.Response, stack: GatewayStack) -> None:
    assert response.headers["x-kvroute-worker"] in {w.worker_id for w in stack.workers}
    assert response.headers["x-kvroute-route"].startswith("policy=kv_aware; reason=")
    assert response.headers["x-request-id"]


# -- bad input: its 4xx, OpenAI's shape, the field named; never a 422 or a 500 ------------------------------------

C, CHAT_URL = "/v1/completions", "/v1/chat/completions"
BAD_INPUTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (case, endpoint, body: dict as JSON or raw bytes, status, param, code)
    ("malformed json", C, b'{"prompt": "hi",', 400, None, None),
    ("not an object", C, b"[1, 2]", 400, None, None),
    ("empty body", C, b"", 400, None, None),
    ("not utf-8", C, b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("NaN", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    ("missing prompt", C, {"max_tokens": 4}, 400, "prompt", None),
    ("missing messages", CHAT_URL, {"max_tokens": 4}, 400, "messages", None),
    ("max_tokens a string", C, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens", None),
    ("max_tokens a float", C, {"prompt": "hi", "max_tokens": 4.5}, 400, "max_tokens", None),
    ("seed a string", C, {"prompt": "hi", "seed": "7"}, 400, "seed", None),
    ("stream a string", C, {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("prompt a number", C, {"prompt": 42}, 400, "prompt", None),
    ("messages a string", CHAT_URL, {"messages": "hello"}, 400, "messages", None),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt", None),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt", None),
    ("two prompts", C, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("empty messages", CHAT_URL, {"messages": []}, 400, "messages", None),
    ("oversize prompt", C, {"prompt": "hello " * 2100}, 400, "prompt", "context_length_exceeded"),
    ("past the context", C, {"prompt": "hello " * 400, "max_tokens": 200}, 400, None, "context_length_exceeded"),
    ("unknown model", C, {"prompt": "hi", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("negative max_tokens", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ("zero max_tokens", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("huge max_tokens", C, {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", None),
    ("max_tokens over the limit", C, {"prompt": "hi", "max_tokens": 257}, 400, "max_tokens", None),
    ("min_tokens over max_tokens", C, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
    ("negative min_tokens", C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens", None),
    ("negative max_completion_tokens", CHAT_URL, {"messages": CHAT, "max_completion_tokens": -5}, 400,
     "max_completion_tokens", None),
    ("negative temperature", C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature", None),
    ("top_p zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("top_p above one", CHAT_URL, {"messages": CHAT, "top_p": 1.5}, 400, "top_p", None),
    ("top_k below -1", C, {"prompt": "hi", "top_k": -2}, 400, "top_k", None),
    ("unknown role", CHAT_URL, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("message without content", CHAT_URL, {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("image part", CHAT_URL, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content[1].type", None),
    ("too many stops", C, {"prompt": "hi", "stop": [str(i) for i in range(9)]}, 400, "stop", None),
    ("empty stop", C, {"prompt": "hi", "stop": ["ok", ""]}, 400, "stop[1]", None),
    ("stop a number", C, {"prompt": "hi", "stop": 5}, 400, "stop", None),
    ("negative stop token id", C, {"prompt": "hi", "stop_token_ids": [3, -1]}, 400, "stop_token_ids[1]", None),
    ("n over the limit", C, {"prompt": "hi", "n": 5}, 400, "n", None),
    ("n zero", CHAT_URL, {"messages": CHAT, "n": 0}, 400, "n", None),
    ("logprobs over 20", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("top_logprobs without logprobs", CHAT_URL, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("stream_options without stream", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("presence penalty", C, {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ("echo", C, {"prompt": "hi", "echo": True}, 400, "echo", None),
    ("unknown response format", CHAT_URL, {"messages": CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format.type", None),
    ("tool without a name", CHAT_URL, {"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0].function.name", None),
    ("tool_choice naming no tool", CHAT_URL, {"messages": CHAT, "tool_choice": {"type": "function",
     "function": {"name": "paint"}}}, 400, "tool_choice.function.name", None),
    ("token id out of vocabulary", C, {"prompt": [1, 2, 10**9]}, 400, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "url", "body", "status", "param", "code"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_4xx_naming_the_field(
    client: httpx.Client, case: str, url: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    if isinstance(body, bytes):
        response = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(url, json=body)
    assert_openai_error(response, status, param, code)
    assert response.headers["x-request-id"]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"])},
    optional={"content": st.text(max_size=30) | JSON_VALUES, "name": JSON_VALUES},
)
FIELDS = ("model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
          "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "top_logprobs", "user", "cache_salt",
          "tools", "response_format", "presence_penalty", "echo", "ignore_eos")  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    url=st.sampled_from([C, CHAT_URL]),
    fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
    messages=st.lists(MESSAGE, max_size=3) | JSON_VALUES,
    prompt=st.text(max_size=40) | st.lists(st.integers(-5, 60_000), max_size=5) | JSON_VALUES,
)
def test_never_a_500(client: httpx.Client, url: str, fields: dict, messages: Any, prompt: Any) -> None:
    """Random bodies, most of them wrong somewhere: every answer is a success or a 4xx in OpenAI's shape."""
    body = {**fields, "messages": messages} if url == CHAT_URL else {"prompt": prompt, **fields}
    for name in ("max_tokens", "max_completion_tokens"):  # valid lengths kept short: this is about shapes
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and 1 <= body[name] <= 256:
            body[name] = min(body[name], 3)
    body.setdefault("max_completion_tokens" if url == CHAT_URL else "max_tokens", 3)
    response = client.post(url, json=body)
    assert response.status_code in (200, 400, 404, 429), response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        sse_events(response)
    else:
        (ChatCompletionResponse if url == CHAT_URL else CompletionResponse).model_validate(response.json())


def test_bad_and_missing_api_keys_get_401(client: httpx.Client) -> None:
    for headers in ({"authorization": "Bearer sk-wrong"}, {"authorization": "Basic abc"}, {"authorization": ""}):
        assert_openai_error(client.post(C, json={"prompt": "hi"}, headers=headers), 401, code="invalid_api_key")
    with httpx.Client(base_url=client.base_url) as anonymous:
        assert_openai_error(anonymous.post(CHAT_URL, json={"messages": CHAT}), 401, code="invalid_api_key")


def test_the_key_is_checked_before_anything_else(client: httpx.Client) -> None:
    """An anonymous or wrong-keyed client gets 401 whatever else is wrong: it learns neither the fields, nor
    the body limit, nor the served model."""
    bad_bodies = [
        (C, {"prompt": "hi", "temperature": -1}),
        (CHAT_URL, b"{not json"),
        (C, {"prompt": "hi", "model": "gpt-9"}),
        (C, {"prompt": "x" * 70_000}),  # over the body limit
    ]
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        with httpx.Client(base_url=client.base_url, headers=headers) as anonymous:
            for url, body in bad_bodies:
                response = anonymous.post(url, content=body if isinstance(body, bytes) else json.dumps(body))
                assert_openai_error(response, 401, code="invalid_api_key")
                assert response.headers["x-request-id"]
            for url in ("/v1/models", f"/v1/models/{SERVED_MODEL}", "/v1/nothing"):
                assert_openai_error(anonymous.get(url), 401, code="invalid_api_key")
            assert anonymous.get("/health").status_code == 200


def test_errors_quote_a_short_prefix_of_what_the_client_sent(client: httpx.Client) -> None:
    long_name = "m" * 60_000
    for response in (
        client.post(C, json={"prompt": "hi", "model": long_name}),
        client.get(f"/v1/models/{'m' * 20_000}"),
    ):
        error = assert_openai_error(response, 404, "model", "model_not_found")
        assert len(response.content) < 400 and "mmm..." in error["message"], response.content[:500]
    response = client.post(CHAT_URL, json={"messages": CHAT, "response_format": {"type": "t" * 50_000}})
    assert_openai_error(response, 400, "response_format.type")
    assert len(response.content) < 400
    assert len(client.get("/v1/" + "n" * 20_000).content) < 400


def test_oversize_body_gets_413_before_it_is_read_whole(client: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    assert_openai_error(client.post(C, content=big), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused while it streams in
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024

    assert_openai_error(client.post(C, content=chunked()), 413, code="request_too_large")


def test_unknown_routes_and_methods_answer_in_openai_shape(client: httpx.Client) -> None:
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get(C), 405)
    assert_openai_error(client.get("/v1/models/gpt-9"), 404, "model", "model_not_found")


def test_server_keeps_serving_after_bad_input(client: httpx.Client, stack: GatewayStack) -> None:
    assert client.get("/health").status_code == 200
    response = client.post(C, json={"prompt": "still here?", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_no_worker_gets_503_and_not_ready(stack: GatewayStack) -> None:
    with httpx.Client(base_url=stack.dead_http_url, headers=AUTH, timeout=10) as dead:
        assert_openai_error(dead.post(C, json={"prompt": "hi"}), 503, code="no_worker_available")
        assert_openai_error(dead.post(CHAT_URL, json={"messages": CHAT, "stream": True}), 503)
        assert dead.get("/health").status_code == 200, "alive, though not ready"
        assert dead.get("/ready").status_code == 503


def test_tenant_over_its_concurrency_gets_429_with_retry_after(client: httpx.Client) -> None:
    small = {"authorization": f"Bearer {SMALL_KEY}"}
    body = {"prompt": "a long answer, please", "max_tokens": 200, "stream": True}
    with client.stream("POST", C, json=body, headers=small) as first:
        assert first.status_code == 200
        second = client.post(C, json={"prompt": "hi", "max_tokens": 2}, headers=small)
        assert_openai_error(second, 429, code="rate_limit_exceeded")
        assert int(second.headers["retry-after"]) >= 1
        other_tenant = client.post(C, json={"prompt": "hi", "max_tokens": 2})
        assert other_tenant.status_code == 200, "the limit is the tenant's, not the gateway's"
    deadline = time.monotonic() + 5
    while (after := client.post(C, json={"prompt": "hi", "max_tokens": 2}, headers=small)).status_code == 429:
        assert time.monotonic() < deadline, "closing the stream releases the tenant's slot"
        time.sleep(0.05)
    assert after.status_code == 200


# -- responses -------------------------------------------------------------------------------------------------


def test_completion_shape_usage_and_cached_tokens(client: httpx.Client, stack: GatewayStack) -> None:
    body = {"prompt": LONG_PROMPT, "max_tokens": 5, "model": SERVED_MODEL}
    index = stack.request_path.fleet.view().kv_index
    held_before = {w.worker_id: index.num_blocks(w.worker_id) for w in stack.workers}
    first = client.post(C, json=body)
    assert first.status_code == 200, first.text
    assert_routed(first, stack)
    parsed = CompletionResponse.model_validate(first.json())
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-") and parsed.model == SERVED_MODEL
    assert [c.index for c in parsed.choices] == [0] and parsed.choices[0].finish_reason == "length"
    usage = first.json()["usage"]
    prompt_tokens = usage["prompt_tokens"]
    assert prompt_tokens > 64 and usage["completion_tokens"] == 5 and usage["total_tokens"] == prompt_tokens + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}, "present, and 0 for a prompt never seen"
    # The second request follows the first's blocks once the gateway has read them (a poll, 50 ms here); sent
    # before, it would be routed by the ring alone, on a routing key the first request has moved.
    holder, blocks = first.headers["x-kvroute-worker"], (prompt_tokens - 1) // 16
    deadline = time.monotonic() + 5
    while stack.request_path.fleet.view().kv_index.num_blocks(holder) < held_before[holder] + blocks:
        assert time.monotonic() < deadline, "the first request's blocks never reached the gateway's index"
        time.sleep(0.01)
    second = client.post(C, json=body)
    assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16, "every full block reused (the last token is always computed)"
    assert second.json()["choices"][0]["text"] == parsed.choices[0].text


def test_chat_shape(client: httpx.Client, stack: GatewayStack) -> None:
    response = client.post(CHAT_URL, json={"messages": CHAT, "max_completion_tokens": 6})
    assert response.status_code == 200, response.text
    assert_routed(response, stack)
    parsed = ChatCompletionResponse.model_validate(response.json())
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content
    assert parsed.choices[0].logprobs is None
    assert parsed.usage.completion_tokens == 6 and parsed.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_shapes_with_and_without_usage(client: httpx.Client, stack: GatewayStack) -> None:
    whole = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 8}).json()
    for include_usage in (False, True):
        body: dict[str, Any] = {"messages": CHAT, "max_tokens": 8, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        response = client.post(CHAT_URL, json=body)
        assert response.status_code == 200
        assert_routed(response, stack)
        events = sse_events(response)
        for event in events:
            ChatCompletionChunk.model_validate(event)
            assert event["object"] == "chat.completion.chunk" and event["id"].startswith("chatcmpl-")
            assert ("usage" in event) == include_usage, "usage: null on every chunk only with include_usage"
        assert len({event["id"] for event in events}) == 1
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        body_events = events[:-1] if include_usage else events
        assert all("role" not in e["choices"][0]["delta"] for e in body_events[1:])
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in body_events)
        assert text == whole["choices"][0]["message"]["content"]
        assert body_events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in body_events[:-1])
        if include_usage:
            assert events[-1]["choices"] == []
            assert events[-1]["usage"]["completion_tokens"] == 8
            assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
            assert "cached_tokens" in events[-1]["usage"]["prompt_tokens_details"]


def test_completion_stream_shapes(client: httpx.Client) -> None:
    whole = client.post(C, json={"prompt": "Once upon a time", "max_tokens": 8}).json()
    body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(client.post(C, json=body))
    for event in events:
        CompletionResponse.model_validate(event)
        assert event["object"] == "text_completion" and event["usage"] is None or event["choices"] == []
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_stop_strings_are_cut_across_token_boundaries(client: httpx.Client) -> None:
    body = {"prompt": "Tell me a story about", "max_tokens": 24, "logprobs": 0}
    full = client.post(C, json=body).json()["choices"][0]
    tokens = full["logprobs"]["tokens"]
    # A stop string made of the end of one token and the start of the next: it exists in no single token.
    text, boundaries = full["text"], [sum(len(t) for t in tokens[: i + 1]) for i in range(len(tokens))]
    stop = next(
        text[b - 2 : b + 2]
        for b, before, after in zip(boundaries[2:-1], tokens[2:-1], tokens[3:], strict=True)
        if len(before) >= 2 and len(after) >= 2 and text.find(text[b - 2 : b + 2]) == b - 2
    )
    expected = text[: text.index(stop)]
    for stream in (False, True):
        request = {"prompt": body["prompt"], "max_tokens": 24, "stop": ["never appears", stop], "stream": stream}
        response = client.post(C, json=request)
        if stream:
            events = sse_events(response)
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
        assert (text, finish) == (expected, "stop"), "the text up to the stop string, without it"


def test_n_choices(client: httpx.Client) -> None:
    response = client.post(C, json={"prompt": "Pick a number", "max_tokens": 4, "n": 3})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12
    events = sse_events(client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 4, "n": 2, "stream": True}))
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1], "a role chunk opens each choice"
    assert all(e["choices"][0]["delta"].get("role") == "assistant" for e in events[:2])
    finished = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finished == [0, 1]


def test_logprobs_shapes(client: httpx.Client) -> None:
    chat = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["logprob"], float) and bytes(entry["bytes"]).decode(errors="replace")
        assert len(entry["top_logprobs"]) <= 2
        assert all(set(top) == {"token", "logprob", "bytes"} for top in entry["top_logprobs"])
    assert (
        "".join(bytes(e["bytes"]).decode(errors="replace") for e in content) == chat["choices"][0]["message"]["content"]
    )
    completion = client.post(C, json={"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(
        isinstance(top, dict) and token in top
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)
    )
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(4)]
    assert logprobs["text_offset"] == offsets
    events = sse_events(
        client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 3, "logprobs": True, "stream": True})
    )
    streamed = [
        entry for e in events[1:] if e["choices"][0]["logprobs"] for entry in e["choices"][0]["logprobs"]["content"]
    ]
    assert len(streamed) == 3


# -- headers, salts, cancellation ---------------------------------------------------------------------------------


def test_request_id_is_echoed_or_generated(client: httpx.Client) -> None:
    echoed = client.post(C, json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "trace-me-42"})
    assert echoed.headers["x-request-id"] == "trace-me-42"
    generated = client.post(C, json={"prompt": "hi", "max_tokens": 1})
    assert generated.json()["id"] == f"cmpl-{generated.headers['x-request-id']}"
    refused = client.post(C, json={"prompt": ""}, headers={"x-request-id": "bad-request-7"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-request-7"


def test_generation_endpoints_read_headers_and_bodies_as_the_other_endpoints(client: httpx.Client) -> None:
    """Every endpoint is served by the one request cycle: a chunked body and a repeated header (the first
    counts) read the same way by the generation and the tokenizer endpoints, and a wrong method is a 405 in
    OpenAI's error shape."""

    def chunked(body: bytes) -> Iterator[bytes]:
        yield from (body[:7], body[7:])

    body = json.dumps({"messages": CHAT, "max_tokens": 2}).encode()
    for path, payload in ((CHAT_URL, body), ("/tokenize", json.dumps({"prompt": "hi"}).encode())):
        headers = [("x-request-id", "first-1"), ("x-request-id", "second-2"), ("content-type", "application/json")]
        response = client.post(path, content=chunked(payload), headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == "first-1"
    wrong = client.get(CHAT_URL)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert wrong.headers["allow"] == "POST"
    head = client.head("/health")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == "15"


def test_a_generation_request_with_a_query_string_is_served_alike(client: httpx.Client, stack: GatewayStack) -> None:
    """A target with a query string is routed by its path: the same bodies, headers and refusals, whole and
    streamed."""
    body = {"prompt": "hi", "max_tokens": 3}
    for path in (C, C + "?via=asgi"):
        whole = client.post(path, json=body, headers={"x-request-id": "asgi-or-not"})
        assert whole.status_code == 200 and whole.headers["x-request-id"] == "asgi-or-not"
        assert_routed(whole, stack)
        assert whole.json()["usage"]["completion_tokens"] == 3
        streamed = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(streamed)
        assert events[-1]["usage"]["completion_tokens"] == 3 and streamed.headers["cache-control"] == "no-cache"
        assert_openai_error(client.post(path, json={"prompt": ""}), 400, param="prompt")
        assert_openai_error(client.post(path, json=body, headers={"authorization": "Bearer nope"}), 401)


def test_client_cache_salt_isolates_cached_prefixes(client: httpx.Client) -> None:
    prompt = "A salted prefix that nobody else sends, repeated until it fills blocks. " * 5
    salted = {"prompt": prompt, "max_tokens": 2, "cache_salt": "team-a"}
    client.post(C, json=salted)
    again = client.post(C, json=salted).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = client.post(C, json={**salted, "cache_salt": "team-b"}).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "another salt never shares blocks"


def test_text_parts_and_tools_reach_the_chat_template(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
    as_parts = client.post(CHAT_URL, json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    as_text = client.post(
        CHAT_URL, json={"messages": [{"role": "user", "content": "Name three\ncolours."}], "max_tokens": 1}
    )
    assert as_parts.json()["usage"]["prompt_tokens"] == as_text.json()["usage"]["prompt_tokens"], "parts join by \\n"
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 1, "tools": tools, "tool_choice": "auto"})
    assert with_tools.status_code == 200, with_tools.text
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
               "function": {"name": "paint", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1",
               "content": "done"}]  # fmt: skip
    assert client.post(CHAT_URL, json={"messages": history, "max_tokens": 1}).status_code == 200
    opened = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    bare = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 1, "add_generation_prompt": False}).json()
    assert bare["usage"]["prompt_tokens"] < opened, "without the assistant turn's opening"


def test_extreme_but_valid_values_are_served(client: httpx.Client) -> None:
    for extreme in (
        {"seed": 2**63 - 1, "n": 2},
        {"seed": -(2**63)},
        {"top_k": 2**31 - 1},
        {"stop_token_ids": [2**32 - 1]},
    ):
        response = client.post(C, json={"prompt": "hi", "max_tokens": 2, **extreme})
        assert response.status_code == 200, (extreme, response.text)


def test_session_header_and_user_are_accepted(client: httpx.Client) -> None:
    by_header = client.post(C, json={"prompt": "hi", "max_tokens": 1}, headers={"x-session-id": "s-1"})
    by_user = client.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 1, "user": "u-1"})
    assert by_header.status_code == by_user.status_code == 200


def test_client_disconnect_mid_stream_cancels_the_worker_request(client: httpx.Client, stack: GatewayStack) -> None:
    before = sum(s.generation_tokens_total for s in stack.wait_workers_idle())
    with client.stream("POST", C, json={"prompt": "Go on forever", "max_tokens": 250, "stream": True}) as response:
        next(response.iter_lines())  # the first event: the worker is generating
    stats = stack.wait_workers_idle()
    assert all(s.num_running == 0 and s.num_blocks_used == 0 for s in stats), "its blocks are freed"
    assert sum(s.generation_tokens_total for s in stats) - before < 250, "cancelled before it finished"


def test_client_disconnect_while_waiting_cancels_the_worker_request(stack: GatewayStack) -> None:
    before = sum(s.generation_tokens_total for s in stack.wait_workers_idle())
    with httpx.Client(base_url=stack.http_url, headers=AUTH, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(C, json={"prompt": "Take your time", "max_tokens": 250})
    stats = stack.wait_workers_idle()
    assert all(s.num_running == 0 and s.num_blocks_used == 0 for s in stats)
    assert sum(s.generation_tokens_total for s in stats) - before < 250


# -- the rest of the API -----------------------------------------------------------------------------------------


def test_models_health_ready_metrics_openapi(client: httpx.Client, stack: GatewayStack) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [SERVED_MODEL]
    assert client.get(f"/v1/models/{SERVED_MODEL}").json()["id"] == SERVED_MODEL
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200 and client.get("/ready").json()["workers"] >= 1
    assert client.get("/metrics").status_code == 404, "metrics are served apart from the API"
    metrics = httpx.get(stack.metrics_url)
    assert metrics.status_code == 200 and "kvroute:gateway_requests_total" in metrics.text
    refused = next(
        line for line in metrics.text.splitlines() if line.startswith("kvroute:gateway_request_errors_total")
    )
    assert float(refused.rsplit(" ", 1)[1]) > 0, "refusals at the front door are counted too"
    doc = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    assert "/metrics" not in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert {"prompt", "max_tokens", "stream_options", "cache_salt"} <= set(schemas["CompletionRequest"]["properties"])
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    request_body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert request_body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_worker_dying_mid_stream_ends_with_an_error_event(client: httpx.Client, stack: GatewayStack) -> None:
    """Last in this module: it stops one of the two workers."""
    with client.stream("POST", C, json={"prompt": "A story that never ends", "max_tokens": 250, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        worker = next(w for w in stack.workers if w.worker_id == r.headers["x-kvroute-worker"])
        stack.call(worker.stop(drain_timeout=0))
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert "error" in last and last["error"]["type"] == "upstream_error", last
    assert client.post(C, json={"prompt": "hi", "max_tokens": 2}).status_code == 200, "the other worker serves"
