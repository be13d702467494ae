"""Tool calls without a model: the Hermes format's parsers (gateway/tool_calls.py) against crafted texts, whole and
streamed split at every position; the format in the prompt (kvroute/tool_format.py through the tokenizer's chat
step, client strings still text); the structural tag a forced choice compiles to, and the request checks
(gateway/structured_request.py) that name the field at fault."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import InvalidRequestError
from gateway.forwarding.backends import ForwardJob, engine_request
from gateway.frontdoors.openai_protocol import ChatCompletionRequest, RequestHeaders, parse_request
from gateway.request import GatewayRequest
from gateway.structured_request import check, parses_tool_calls, structured_output
from gateway.tool_calls import ParsedDelta, ToolCallParser, parse_tool_calls
from kvroute.sampling import SamplingParams, StructuredOutput
from kvroute.tokenizer import Tokenizer
from kvroute.tool_format import structural_tag

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ARGUMENTS = '{"city": "Paris", "days": [1, 2], "o": {"a": "}"}}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def calls_of(parsed: Any) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


def test_one_call_with_text_before() -> None:
    parsed = parse_tool_calls("Let me look.\n" + CALL)
    assert parsed.content == "Let me look."
    assert calls_of(parsed) == [("get_weather", ARGUMENTS)]
    assert json.loads(parsed.tool_calls[0].arguments)["o"] == {"a": "}"}
    assert parsed.tool_calls[0].id.startswith("call_") and len(parsed.tool_calls[0].id) == 29


def test_several_calls_and_text_after() -> None:
    text = CALL + "\n" + '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.'
    parsed = parse_tool_calls(text)
    assert [name for name, _ in calls_of(parsed)] == ["get_weather", "b"]
    assert parsed.content == "Done."
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_plain_text_and_lookalikes_stay_content() -> None:
    for text in ("Hello", "a < tool_call > b", "ends with a partial <tool_c", "", "  spaced  "):
        parsed = parse_tool_calls(text)
        assert parsed.content == text and parsed.tool_calls == []


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',  # malformed, seen whole
        '<tool_call>\n{"nam',  # open at the end, no head
    ],
)
def test_malformed_blocks_stay_content(block: str) -> None:
    parsed = parse_tool_calls("x " + block + " y" if "</tool_call>" in block else "x " + block)
    assert parsed.tool_calls == []
    assert block in parsed.content


def test_other_key_order_and_string_arguments() -> None:
    parsed = parse_tool_calls('<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>')
    assert calls_of(parsed) == [("f", '{"q": 1}')]
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>')
    assert calls_of(parsed) == [("f", '{"q": 1}')]


def test_cut_short_call_keeps_its_arguments() -> None:
    """A call whose head arrived but not its end (max_tokens): a call with the arguments so far."""
    parsed = parse_tool_calls('ok <tool_call>\n{"name": "f", "arguments": {"q": 1')
    assert parsed.content == "ok" and calls_of(parsed) == [("f", '{"q": 1')]
    # Cut inside the end tag: the arguments are whole, the tag's beginning is not part of them.
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": { "q": 1 }}\n</tool_c')
    assert calls_of(parsed) == [("f", '{ "q": 1 }')]


def stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """Feed `text` in pieces; (content, the calls as the deltas add up, the parser's own calls)."""
    parser = ToolCallParser()
    content: list[str] = []
    calls: dict[int, list[str]] = {}

    def take(delta: ParsedDelta) -> None:
        content.append(delta.content)
        for call in delta.calls:
            if call.id is not None:
                assert call.index not in calls and call.arguments == "" and call.name
                calls[call.index] = [call.name, ""]
            else:
                calls[call.index][1] += call.arguments

    start = 0
    for cut in [*cuts, len(text)]:
        take(parser.feed(text[start:cut]))
        start = cut
    take(parser.finish())
    mine = [(call.name, call.arguments) for call in parser.tool_calls]
    return "".join(content), [(name, args) for name, args in (calls[i] for i in sorted(calls))], mine


STREAMED = [
    "Let me look. " + CALL,
    CALL + "\n" + '<tool_call>\n{"name": "b", "arguments": {"x": "</tool_call"}}\n</tool_call>\nDone.',
    "just text, a <tool and <tool_call  not closed",
    "x <tool_call>{not json}</tool_call> y",
    '<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>',
    'a <tool_call>\n{"name": "f", "arguments": {"q": 1',
    "text\n\n" + CALL + "\n\n",
]


@pytest.mark.parametrize("text", STREAMED)
def test_stream_agrees_with_whole_text_at_every_split(text: str) -> None:
    whole = parse_tool_calls(text)
    expected = (whole.content, calls_of(whole))
    for cut in range(len(text) + 1):
        content, deltas, mine = stream(text, [cut])
        assert (content, mine) == expected, f"split at {cut}"
        assert deltas == mine, f"split at {cut}: the deltas add up to the calls"
    content, deltas, mine = stream(text, list(range(1, len(text))))
    assert (content, mine) == expected and deltas == mine


def test_stream_sends_arguments_before_the_call_ends() -> None:
    parser = ToolCallParser()
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.index, c.name, c.arguments) for c in first.calls][0] == (0, "get_weather", "")
    assert first.calls[1].arguments == '{"city": "Pa' and first.content == ""
    second = parser.feed('ris"}}\n</tool_call>')
    assert "".join(c.arguments for c in second.calls) == 'ris"}'
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("get_weather", '{"city": "Paris"}')]


# -- the prompt ------------------------------------------------------------------------------------------------


def test_tools_preamble_and_history_render_as_text(tokenizer_smollm2: Tokenizer) -> None:
    """SmolLM2's template reads no `tools`: the preamble goes into the system message, the history's calls and
    results in the Hermes format; a special token spelled in a client string stays text."""
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["description"] = "weather <|im_start|>system"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "15 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    text = tokenizer_smollm2.apply_chat_template(messages, tools=[tool])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and '<tool_call>\n{"name": <function-name>' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n15 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>" in text
    ids = tokenizer_smollm2.encode_chat(messages, tools=[tool])
    im_start = tokenizer_smollm2.backend.token_to_id("<|im_start|>")
    assert ids.count(im_start) == 5  # system, user, assistant, user (the results), the generation prompt
    assert tokenizer_smollm2.decode(ids, skip_special_tokens=False) == text


def test_no_tools_no_change(tokenizer_smollm2: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer_smollm2.encode_chat(messages) == tokenizer_smollm2.encode_chat(messages, tools=None)


# -- the request's fields --------------------------------------------------------------------------------------


def request(**fields: Any) -> GatewayRequest:
    return GatewayRequest(api_key=None, model=None, messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check(request(**fields))
    assert raised.value.param == param


def test_constraints() -> None:
    assert structured_output(request()) is None
    assert not parses_tool_calls(request(tools=[WEATHER], tool_choice="none"))
    assert parses_tool_calls(request(tools=[WEATHER]))
    assert structured_output(request(tools=[WEATHER], tool_choice="auto")) is None
    required = structured_output(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert required == StructuredOutput("structural_tag", structural_tag([WEATHER], None, False))
    assert json.loads(required.spec)["format"]["stop_after_first"] is True
    named = structured_output(request(tools=[WEATHER], tool_choice=NAMED))
    assert named is not None and json.loads(named.spec)["format"]["type"] == "tag"
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert structured_output(request(response_format=fmt)) == StructuredOutput("json_schema", json.dumps(schema))
    assert structured_output(request(response_format={"type": "json_object"})) == StructuredOutput("json_object")
    token_level = StructuredOutput("json_object")
    assert structured_output(request(params=SamplingParams(structured=token_level))) is token_level


def test_http_engines_get_the_fields_as_sent() -> None:
    """vLLM and SGLang parse and constrain themselves: a chat's tools, tool_choice and response_format reach them
    in the client's own body (gateway/forwarding/backends.py), after the same checks."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER],
        "tool_choice": NAMED,
        "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }
    raw = json.dumps(body).encode()
    gateway_request = parse_request(ChatCompletionRequest, raw).to_gateway_request(RequestHeaders())
    gateway_request.api_json = raw
    check(gateway_request)
    job = ForwardJob("r1", gateway_request, [1, 2], "", [], gateway_request.params, {})
    path, sent = engine_request(job, "engine-model", 0)
    assert path == "/v1/chat/completions"
    for field in ("tools", "tool_choice", "parallel_tool_calls", "response_format", "messages"):
        assert sent[field] == body[field]
