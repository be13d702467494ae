"""The tool-call format kvroute's own workers speak, in one place: Hermes-style `<tool_call>` JSON.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Three parts must agree on it, and all three read it from here:

- the prompt: a model whose chat template reads `tools` (Qwen2.5, Hermes) is given them as the template variable;
  for one whose template does not (SmolLM2's), `for_template` writes the tools into the system message as a
  preamble (Qwen2.5's wording) and renders the history's tool calls and tool results as this format's text
  (`<tool_call>` in an assistant turn, `<tool_response>` in a user turn);
- the grammar: `structural_tag` is what `tool_choice` `required` or a named function constrains the output to
  (xgrammar's structural-tag JSON, compiled by the worker);
- the parser: gateway/tool_calls.py reads TOOL_CALL_BEGIN / TOOL_CALL_END and the call's JSON back out.

Tools here are OpenAI chat's definitions, `{"type": "function", "function": {"name", "description"?,
"parameters"?}}`, already checked by the gateway (gateway/structured_request.py).
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# What a constrained call looks like, around its arguments (a JSON object): the spacing json.dumps gives.
_CALL_HEAD = TOOL_CALL_BEGIN + '\n{"name": "'
_CALL_ARGUMENTS = '", "arguments": '
_CALL_TAIL = "}\n" + TOOL_CALL_END
# Whitespace the grammar lets a call's arguments hold in a row: JSON's own spacing, never a run a small model
# can fill its whole budget with.
MAX_WHITESPACE_RUN = 1

# The parameters of a function that declares none: OpenAI's "an empty parameter list".
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

_PREAMBLE_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_PREAMBLE_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (NO_PARAMETERS when it declares none)."""
    parameters = tool["function"].get("parameters")
    return NO_PARAMETERS if parameters is None else parameters


def structural_tag(tools: list[dict[str, Any]], name: str | None, parallel_tool_calls: bool = True) -> str:
    """The structural tag (JSON text) that output of tool calls only must match: one call of the function
    `name`, or (None) one or more calls of any of `tools` (one only unless `parallel_tool_calls`), each
    `<tool_call>` holding that function's name and arguments its parameters schema accepts, calls separated
    by a newline. Nothing else may be written: what `tool_choice` `required` or a named function asks."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    tags = [
        {
            "type": "tag",
            "begin": _CALL_HEAD + tool["function"]["name"] + _CALL_ARGUMENTS,
            "content": {
                "type": "json_schema",
                "json_schema": parameters_of(tool),
                "max_whitespace_cnt": MAX_WHITESPACE_RUN,
            },
            "end": _CALL_TAIL,
        }
        for tool in chosen
    ]
    if name is not None:
        (call_format,) = tags
    else:
        call_format = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel_tool_calls,
        }
    return json.dumps({"type": "structural_tag", "format": call_format}, ensure_ascii=False)


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    """The system prompt's part that offers `tools` in this format (Qwen2.5's wording)."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _PREAMBLE_HEAD + listed + _PREAMBLE_TAIL


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` as a template that does not read `tools` renders them in this format: the tools' preamble
    in the system message (one is added first when there is none), each assistant's `tool_calls` as
    `<tool_call>` text after its content, and each run of `tool` messages as one user message of
    `<tool_response>` blocks. Messages without tool fields are passed on as they are."""
    out: list[dict[str, Any]] = []
    if tools:
        preamble = tools_preamble(tools)
        if messages and messages[0].get("role") == "system":
            content = messages[0].get("content") or ""
            out.append({**messages[0], "content": f"{content}\n\n{preamble}" if content else preamble})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": preamble})
    responses: dict[str, Any] | None = None  # the user message the current run of tool results goes into
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if responses is None:
                responses = {"role": "user", "content": block}
                out.append(responses)
            else:
                responses["content"] += "\n" + block
            continue
        responses = None
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            content = message.get("content") or ""
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append(message)
    return out


def needs_rewrite(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether `for_template` changes anything (the common chat has no tools: nothing to copy)."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _call_text(call: Any) -> str:
    """An earlier call (OpenAI's `{"id", "type", "function": {"name", "arguments"}}`, arguments a JSON string)
    as the model wrote it; arguments that are not JSON are kept as the string they are."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return f"{TOOL_CALL_BEGIN}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_END}"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_BEGIN}\n{body}\n{TOOL_CALL_END}"
