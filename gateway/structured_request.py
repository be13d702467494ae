"""A request's `tools`, `tool_choice` and `response_format`: checked, and turned into the constraint a kvroute
worker decodes under (`SamplingParams.structured`).

Every front door that sets these fields on a GatewayRequest (chat completions, the Responses API) gets the same
rules, because the request path applies them (`check`, then `structured_output`):

- `tools`: OpenAI chat's definitions, `{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}`; a name matches NAME_PATTERN and is unique; parameters is a JSON schema object.
- `tool_choice`: `none` (tools stay in the prompt, nothing is parsed), `auto` (unconstrained, calls parsed from
  the text), `required` (one or more calls, grammar-forced), or `{"type": "function", "function": {"name"}}`
  naming a listed tool (exactly that call, grammar-forced). Default: `auto` with tools, `none` without.
- `response_format`: `text`, `json_object`, or `json_schema` with `json_schema.schema` (an object) and a name.
  A forced tool call wins over it (the output is the call); under `auto` it constrains the text.

Whether a schema compiles is the worker's grammar backend's to say: it refuses with INVALID_ARGUMENT naming
`structured`, which the request path names back as `param_of_structured` says. HTTP engines get the fields in
the client's own body and apply their own parsers and grammars.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.errors import InvalidRequestError, quoted
from gateway.request import GatewayRequest
from kvroute import tool_format
from kvroute.sampling import StructuredOutput

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check(request: GatewayRequest) -> None:
    """InvalidRequestError naming the first field at fault (`tools[1].function.name`), else None."""
    names = _check_tools(request.tools)
    _check_tool_choice(request.tool_choice, names)
    _check_response_format(request.response_format)


def forced_tool(request: GatewayRequest) -> tuple[bool, str | None]:
    """(whether a tool call is forced, the function's name when one is named)."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        return True, choice["function"]["name"]
    return choice == "required", None


def parses_tool_calls(request: GatewayRequest) -> bool:
    """Whether the output is read for tool calls: tools are offered and tool_choice is not `none`."""
    return bool(request.tools) and request.tool_choice != "none"


def structured_output(request: GatewayRequest) -> StructuredOutput | None:
    """The constraint a kvroute worker decodes `request` under (None: unconstrained); a token-level client's
    own `params.structured` when the request sets none of the three fields. Call after `check`."""
    forced, name = forced_tool(request)
    if forced:
        assert request.tools is not None  # check() refuses a forced call without tools
        return StructuredOutput(
            "structural_tag", tool_format.structural_tag(request.tools, name, request.parallel_tool_calls)
        )
    kind = (request.response_format or {}).get("type", "text")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        assert request.response_format is not None
        schema = request.response_format["json_schema"]["schema"]
        return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False))
    return request.params.structured


def param_of_structured(request: GatewayRequest) -> str:
    """The client's field a worker's refusal of `structured` is about."""
    if forced_tool(request)[0]:
        return "tools"
    if (request.response_format or {}).get("type", "text") != "text":
        return "response_format"
    return "structured"


def _check_tools(tools: Any) -> set[str]:
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise InvalidRequestError("must be a list of tool definitions", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError("must be an object", param=where)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"must be 'function' (the only tool type served), got {quoted(tool.get('type'))}", param=f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError("is required: an object with a name", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("is required: a string", param=f"{where}.function.name")
        if not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(
                f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {quoted(name)}", param=f"{where}.function.name"
            )
        if name in names:
            raise InvalidRequestError(f"{quoted(name)} is defined twice", param=f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError("must be a string", param=f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError("must be a JSON schema object", param=f"{where}.function.parameters")
    return names


def _check_tool_choice(choice: Any, names: set[str]) -> None:
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not names:
            raise InvalidRequestError("'required' needs at least one tool in tools", param="tool_choice")
        return
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'must be {"type": "function", "function": {"name": ...}} to name a tool', param="tool_choice"
            )
        if name not in names:
            raise InvalidRequestError(f"names {quoted(name)}, which is not in tools", param="tool_choice.function.name")
        return
    raise InvalidRequestError(
        f"must be 'none', 'auto', 'required' or a named function, got {quoted(choice)}", param="tool_choice"
    )


def _check_response_format(response_format: Any) -> None:
    if response_format is None:
        return
    if not isinstance(response_format, dict):
        raise InvalidRequestError("must be an object with a type", param="response_format")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequestError(
            f"must be one of {', '.join(RESPONSE_FORMATS)}, got {quoted(kind)}", param="response_format.type"
        )
    if kind != "json_schema":
        return
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("is required for type json_schema", param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequestError(
            f"is required and must match ^[a-zA-Z0-9_-]{{1,64}}$, got {quoted(name)}",
            param="response_format.json_schema.name",
        )
    if not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError("is required: a JSON schema object", param="response_format.json_schema.schema")
