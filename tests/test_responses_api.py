"""`/v1/responses` through the official `openai` client against a gateway over a real `tiny` worker: whole and
streamed (every event parsed by the SDK's own types, in OpenAI's order), five turns chained by
`previous_response_id` whose prompts extend each other token for token, retrieve, delete, `input_items`,
tenancy (another tenant's id is the same 404 as an unknown one), and bad items.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator

import httpx
import openai
import pytest
from gateway_stack import KEY, SERVED_MODEL, SMALL_KEY, GatewayStack, StackOptions, stack_fixture
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

stack = stack_fixture(StackOptions(model="tiny", workers=2, num_kv_blocks=256, max_model_len=1024))
OTHER_KEY = SMALL_KEY  # another tenant
HEADERS = {"authorization": f"Bearer {KEY}"}


def _client(stack: GatewayStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(stack: GatewayStack) -> Iterator[openai.OpenAI]:
    with _client(stack, KEY) as opened:
        yield opened


@pytest.fixture(scope="module")
def other(stack: GatewayStack) -> Iterator[openai.OpenAI]:
    with _client(stack, OTHER_KEY) as opened:
        yield opened


def test_create_whole(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=SERVED_MODEL, input="Say hello.", instructions="You are terse.", max_output_tokens=6, temperature=0,
        metadata={"case": "whole"},
    )  # fmt: skip
    assert isinstance(response, Response) and response.object == "response"
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.output_text == response.output[0].content[0].text
    assert response.usage is not None and response.usage.output_tokens <= 6
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert response.metadata == {"case": "whole"} and response.instructions == "You are terse."
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=SERVED_MODEL, input="Count.", max_output_tokens=5, temperature=0)
    events = list(client.responses.create(
        model=SERVED_MODEL, input="Count.", max_output_tokens=5, temperature=0, stream=True
    ))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    last = events[-1].response
    assert last.output_text == text and last.usage is not None and last.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(last.id).output_text == text


def test_five_turns_extend_the_prompt(client: openai.OpenAI) -> None:
    previous = None
    turns = []
    for turn in range(5):
        response = client.responses.with_raw_response.create(
            model=SERVED_MODEL, input=f"Turn {turn}: tell me more.", instructions="You are terse.",
            max_output_tokens=24, temperature=0, previous_response_id=previous,
        )  # fmt: skip
        parsed = response.parse()
        turns.append((parsed, response.headers["x-kvroute-route"], response.headers["x-kvroute-worker"]))
        previous = parsed.id
    for (before, _, worker), (after, route, next_worker) in zip(turns, turns[1:], strict=False):
        assert before.usage is not None and after.usage is not None
        whole = before.usage.input_tokens + before.usage.output_tokens
        blocks = (whole - 1) // 16 * 16  # the last sampled token is never computed
        assert after.usage.input_tokens > whole
        assert after.usage.input_tokens_details.cached_tokens >= 0.95 * blocks, (before.usage, after.usage)
        assert "reason=conversation" in route and next_worker == worker
    items = client.responses.input_items.list(turns[-1][0].id, order="asc", limit=100)
    texts = [item.content[0].text for item in items.data if item.type == "message" and item.role == "user"]
    assert texts == [f"Turn {turn}: tell me more." for turn in range(5)]
    assert sum(1 for item in items.data if item.type == "message" and item.role == "assistant") == 4
    page = client.responses.input_items.list(turns[-1][0].id, limit=2)
    assert len(page.data) == 2 and page.has_more and page.data[0].content[0].text == "Turn 4: tell me more."


def test_delete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=SERVED_MODEL, input="Bye.", max_output_tokens=2)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=SERVED_MODEL, input="again", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false(client: openai.OpenAI) -> None:
    response = client.responses.create(model=SERVED_MODEL, input="Hi.", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_other_tenant_gets_404(client: openai.OpenAI, other: openai.OpenAI) -> None:
    mine = client.responses.create(model=SERVED_MODEL, input="A secret.", max_output_tokens=2)
    for call in (
        lambda: other.responses.retrieve(mine.id),
        lambda: other.responses.input_items.list(mine.id),
        lambda: other.responses.delete(mine.id),
        lambda: other.responses.create(model=SERVED_MODEL, input="go on", previous_response_id=mine.id),
        lambda: other.responses.retrieve("resp_" + "0" * 48),
        lambda: other.responses.retrieve(f"{mine.id}}}:r:{{x"),  # key-like ids are never looked up
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert "resp_" in refused.value.body["message"]
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({}, "input"),
    ],
)
def test_bad_input(client: openai.OpenAI, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body={"model": SERVED_MODEL, **body}, cast_to=dict)
    assert refused.value.body["param"] == param


def test_events_match_openais_schema(stack: GatewayStack) -> None:
    """Every event validates against the SDK's own pydantic types (the client itself only constructs them)."""
    by_type = {typing.get_args(kind.model_fields["type"].annotation)[0]: kind for kind in _event_types()}
    body = {"model": SERVED_MODEL, "input": "Count to three.", "max_output_tokens": 6, "temperature": 0,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.http_url}/v1/responses", json=body, headers=HEADERS, timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        events = [sse for sse in _sse(answer.iter_lines())]
    assert events, "no events"
    for name, data in events:
        assert data["type"] == name
        by_type[name].model_validate(data)
    final = Response.model_validate(events[-1][1]["response"])
    assert final.usage is not None and final.output_text


def test_langchain_responses_api(stack: GatewayStack) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=SERVED_MODEL, base_url=f"{stack.http_url}/v1", api_key=KEY, use_responses_api=True, max_tokens=6,
        temperature=0, max_retries=0,
    )  # fmt: skip
    answer = chat.invoke([("system", "You are terse."), ("human", "Say hello.")])
    assert answer.text and answer.response_metadata["id"].startswith("resp_")
    streamed = "".join(chunk.text for chunk in chat.stream("Say hello."))
    assert streamed


def _event_types() -> tuple[type[BaseModel], ...]:
    union = typing.get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
    return typing.get_args(union)


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            assert name is not None, "a data line without its event line"
            yield name, json.loads(line.removeprefix("data: "))
            name = None


def test_a_client_that_leaves_frees_the_blocks(stack: GatewayStack) -> None:
    body = {"model": SERVED_MODEL, "input": "Write a long story.", "max_output_tokens": 400, "stream": True,
            "temperature": 1.0, "seed": 7}  # fmt: skip
    with httpx.stream("POST", f"{stack.http_url}/v1/responses", json=body, headers=HEADERS, timeout=60) as answer:
        deltas = 0
        for name, _ in _sse(answer.iter_lines()):
            deltas += name == "response.output_text.delta"
            if deltas == 3:
                break
    stats = stack.wait_workers_idle(timeout=10)
    assert all(s.num_running == 0 and s.num_blocks_used == 0 for s in stats), stats
