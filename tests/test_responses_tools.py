"""Function tools and structured output through `/v1/responses`, with the real clients unmodified: the openai
SDK's function-call round trip (whole and streamed, `function_call_output` continuing a stored response), a
named function, `text.format` JSON schema; the OpenAI Agents SDK running an agent with one function tool (its
history re-sent, and chained by `previous_response_id`); LangChain's `ChatOpenAI(use_responses_api=True)` with a
bound tool. The model is a small random Llama, so answers are arbitrary: what is checked is that every forced
call and every schema parses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from gateway_stack import KEY, SERVED_MODEL, GatewayStack, StackOptions, stack_fixture
from pydantic import BaseModel

stack = stack_fixture(StackOptions(model="tiny", workers=2, num_kv_blocks=512, max_model_len=2048))

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# A random model spells a call's forced markup in whatever tokens it likes, a character each at worst.
MAX_CALL_TOKENS = 160
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(stack: GatewayStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as opened:
        yield opened


def _calls(response: openai.types.responses.Response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=SERVED_MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=MAX_CALL_TOKENS, temperature=0,
    )  # fmt: skip
    calls = _calls(first)
    assert calls, first.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert json.loads(call.arguments)["city"] in ("Paris", "Lima", "Oslo")
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"} for call in calls]
    second = client.responses.create(
        model=SERVED_MODEL, input=outputs, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens >= 16
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in items][-len(calls) - len(calls) :] == ["function_call"] * len(calls) + [
        "function_call_output"
    ] * len(calls)


def test_named_function_streamed(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model=SERVED_MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=MAX_CALL_TOKENS, temperature=0,
        stream=True, tool_choice={"type": "function", "name": "get_weather"},
    ))  # fmt: skip
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments and json.loads(done[0].arguments)["city"] in ("Paris", "Lima", "Oslo")
    final = events[-1].response
    assert [item.type for item in final.output].count("function_call") == len(done)
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_json_schema_output(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=SERVED_MODEL, input="Describe the weather as JSON.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": CITY_SCHEMA, "strict": True}},
    )  # fmt: skip
    assert response.status == "completed", response.incomplete_details
    answer = json.loads(response.output_text)
    assert answer["city"] in ("Paris", "Lima") and isinstance(answer["sunny"], bool)
    assert response.text is not None and response.text.format.type == "json_schema"


def test_openai_agents_sdk(stack: GatewayStack) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Lima", "Oslo"]) -> str:  # an enum: a random model's string never ends
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    class Report(BaseModel):
        city: Literal["Paris", "Lima", "Oslo"]
        sunny: bool

    async def run(chained: bool) -> Report:
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0) as client:
            agent = Agent(
                name="weather", instructions="Look the weather up, then report it.", tools=[get_weather],
                model=OpenAIResponsesModel(SERVED_MODEL, client), output_type=Report,
                model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                             max_tokens=MAX_CALL_TOKENS, temperature=0),  # fmt: skip
            )  # fmt: skip
            # The SDK resets tool_choice after the call; the report is then held to its schema by the grammar.
            result = await Runner.run(agent, "Weather in Oslo?", max_turns=4, auto_previous_response_id=chained)
            return result.final_output_as(Report)

    for chained in (False, True):
        asked.clear()
        report = asyncio.run(run(chained))
        assert asked, "the agent never called its tool"
        assert report.city in ("Paris", "Lima", "Oslo")


def test_langchain_bound_tool(stack: GatewayStack) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=SERVED_MODEL, base_url=f"{stack.http_url}/v1", api_key=KEY, use_responses_api=True,
        max_tokens=MAX_CALL_TOKENS, temperature=0, max_retries=0,
    )  # fmt: skip
    answer = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Lima?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    assert answer.tool_calls[0]["args"]["city"] in ("Paris", "Lima", "Oslo")
