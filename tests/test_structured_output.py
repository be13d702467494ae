"""Grammar-masked decoding on SmolLM2, in the engine and through a real fleet with the official `openai` client:
`tool_choice` required and named, `response_format` json_schema and json_object, whole and streamed: every answer
parses and validates against its schema. Also: a compile failure refused by name, a max_tokens cutoff ends
`length`, preemption keeps each sequence's grammar where it was, a cancelled constrained request leaves the block
pool's books whole, and the sim runner ignores constraints.

Schemas are bounded (enums, maxLength) so that a 135M model's constrained answer ends within a few dozen tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import torch
from gateway_stack import KEY, SERVED_MODEL, GatewayStack, StackOptions, stack_fixture

from kvroute.sampling import InvalidRequest, SamplingParams, StructuredOutput
from kvroute.sampling_proto import sampling_from_proto, sampling_to_proto
from kvroute.tool_format import structural_tag
from worker.config import EngineConfig
from worker.engine import LLMEngine

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME_PARAMETERS},
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}  # valid JSON, refused by xgrammar


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """On a shared machine each parallel op can stall waiting for a core (tests/test_engine.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2", num_kv_blocks=64, max_model_len=1024))


def prompt(engine: LLMEngine, tools: list[dict[str, Any]] | None = None) -> list[int]:
    return engine.tokenizer.encode_chat(MESSAGES, tools=tools)


def tool_call_output(engine: LLMEngine, text_ids: list[int]) -> list[dict[str, Any]]:
    text = engine.tokenizer.decode(text_ids)
    blocks = [part.split("</tool_call>")[0] for part in text.split("<tool_call>")[1:]]
    return [json.loads(block) for block in blocks]


# -- the engine --------------------------------------------------------------------------------------------------


def test_json_schema_in_the_engine(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=48, temperature=0, structured=StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA))
    )
    (result,) = engine.generate([prompt(engine)], params)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids)), ANSWER_SCHEMA)
    engine.check_invariants()


def test_forced_tool_call_in_the_engine(engine: LLMEngine) -> None:
    spec = StructuredOutput("structural_tag", structural_tag(TOOLS, "get_time"))
    (result,) = engine.generate(
        [prompt(engine, TOOLS)], SamplingParams(max_tokens=48, temperature=0.7, seed=3, structured=spec)
    )
    assert result.finish_reason == "stop"
    (call,) = tool_call_output(engine, result.token_ids)
    assert call["name"] == "get_time"
    jsonschema.validate(call["arguments"], TIME_PARAMETERS)


def test_compile_failure_is_refused_by_name(engine: LLMEngine) -> None:
    bad = StructuredOutput("json_schema", json.dumps(BAD_SCHEMA))
    with pytest.raises(InvalidRequest) as raised:
        engine.add_request("bad", prompt(engine), SamplingParams(structured=bad))
    assert raised.value.field == "structured" and "does not compile" in str(raised.value)
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="structured: json_schema is not valid JSON"):
        SamplingParams(structured=StructuredOutput("json_schema", "{")).validate()


def test_max_tokens_cuts_a_grammar_short(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=3, temperature=0, structured=StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA))
    )
    (result,) = engine.generate([prompt(engine)], params)
    assert result.finish_reason == "length" and len(result.token_ids) == 3


def test_preemption_keeps_the_grammar_where_it_was() -> None:
    """Three constrained sequences of 2-block prompts in 7 blocks, none reserved for decoding: one is preempted
    and recomputed; each still answers exactly what it answers alone (greedy), a whole JSON value of its schema."""
    small = LLMEngine(EngineConfig(model="smollm2", num_kv_blocks=7, max_model_len=1024, decode_reserve_tokens=0))
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=StructuredOutput("json_schema", json.dumps(ANSWER_SCHEMA))
    )
    prompts = [
        small.tokenizer.encode_chat(
            [{"role": "system", "content": f"Case {i}. Answer in JSON."}, {"role": "user", "content": "The weather?"}]
        )
        for i in range(3)
    ]
    alone = [small.generate([p], params)[0].token_ids for p in prompts]
    together = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [r.token_ids for r in together] == alone
    for result in together:
        jsonschema.validate(json.loads(small.tokenizer.decode(result.token_ids)), ANSWER_SCHEMA)
    small.check_invariants()


def test_cancelled_constrained_request_frees_its_blocks(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput("json_object"))
    engine.add_request("cancel-me", prompt(engine), params)
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    engine.abort_request("cancel-me")
    engine.step()
    engine.check_invariants()
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used_blocks == 0


def test_the_sim_runner_ignores_constraints() -> None:
    sim = LLMEngine(EngineConfig(model="sim", num_kv_blocks=16, sim_decode_ms_per_step=0, sim_prefill_us_per_token=0))
    params = SamplingParams(max_tokens=5, structured=StructuredOutput("json_object"))
    (result,) = sim.generate([[1, 2, 3]], params)
    assert result.finish_reason == "length" and len(result.token_ids) == 5


def test_the_wire_carries_the_constraint() -> None:
    for structured in (
        StructuredOutput("json_object"),
        StructuredOutput("json_schema", '{"type": "object"}'),
        StructuredOutput("structural_tag", structural_tag(TOOLS, None)),
        None,
    ):
        params = SamplingParams(max_tokens=7, structured=structured)
        assert sampling_from_proto(sampling_to_proto(params)) == params


# -- through a fleet, with the openai client ---------------------------------------------------------------------

stack = stack_fixture(StackOptions(model="smollm2", workers=1, num_kv_blocks=128, max_model_len=1024))


@pytest.fixture(scope="module")
def client(stack: GatewayStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as opened:
        yield opened


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", named("get_time")])
def test_forced_tool_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    names = {"get_time"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, names)


def test_forced_tool_calls_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0, stream=True,
    )  # fmt: skip
    firsts: list[Any] = []
    arguments: dict[int, str] = {}
    finish = []
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.type == "function" and delta.function.name and delta.function.arguments == ""
                firsts.append(delta)
                arguments[delta.index] = ""
            else:
                assert delta.function.name is None
                arguments[delta.index] += delta.function.arguments
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert finish == ["tool_calls"] and [first.index for first in firsts] == [0]
    name = firsts[0].function.name
    jsonschema.validate(json.loads(arguments[0]), SCHEMAS[name])
    whole = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0,
    )  # fmt: skip
    (call,) = whole.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (name, arguments[0])


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(client: openai.OpenAI, stream: bool) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
    }
    answer = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, response_format=response_format, max_tokens=48, temperature=0,
        stream=stream,
    )  # fmt: skip
    if stream:
        chunks = list(answer)  # type: ignore[arg-type]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        content, finish = answer.choices[0].message.content, [answer.choices[0].finish_reason]  # type: ignore[union-attr]
    assert finish == ["stop"]
    jsonschema.validate(json.loads(content), ANSWER_SCHEMA)


def test_json_object(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=64, temperature=0
    )
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # a model may fill an unbounded object to max_tokens: a clear cutoff, never a hang
        assert choice.finish_reason == "length" and response.usage is not None
        assert response.usage.completion_tokens == 64


def test_max_tokens_cutoff_is_length(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=4
    )
    assert response.choices[0].finish_reason == "length"


def test_tool_history_round_trip(client: openai.OpenAI) -> None:
    """An assistant's earlier call and its result render through the template; the answer is text (`none`)."""
    first = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named("get_weather"), max_tokens=64,
        temperature=0,
    )  # fmt: skip
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    history: list[Any] = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 15}'},
    ]
    answer = client.chat.completions.create(
        model=SERVED_MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "15 C"}]}, "messages[1].tool_call_id"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**body)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_cancelled_stream_leaves_the_pool_whole(client: openai.OpenAI, stack: GatewayStack) -> None:
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=200,
        temperature=1.0, stream=True,
    )  # fmt: skip
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    (stats,) = stack.wait_workers_idle(timeout=10)
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    (worker,) = stack.workers
    stack.call(worker.engine.call(lambda engine: engine.check_invariants()))
