"""The Responses API's request body (`POST /v1/responses`) and its items, checked, and the conversation they
make, as chat messages for the model's template.

What is served: `input` as a string or a list of items (messages with text content, `function_call` and
`function_call_output` items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stop` (vLLM's
extension), `metadata`, `stream`, `store`, `previous_response_id`, function `tools` with `tool_choice` and
`parallel_tool_calls`, `text.format` (text, json_object, json_schema), `user` and `prompt_cache_key` (the
`session` policy's key). What is not (built-in tools, images and files, background responses, truncation
"auto", the Conversations API, item references) is refused with a 400 naming the field, never ignored.

An item is normalised to the shape the API returns it in (an id, a type, `status` where OpenAI has one), so that
a stored conversation lists its items (`input_items`) as OpenAI does.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import Field

from gateway.errors import InvalidRequestError, quoted
from gateway.frontdoors.openai_protocol import INT32_MAX, OpenAIModel, StopField, stop_strings

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_ITEMS = 4096  # input items of one request
ID_BYTES = 24  # 192 random bits an id: not guessable
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSERVED_ITEMS = {
    "item_reference": "item references are not supported; send the item itself",
    "reasoning": "this server produces no reasoning items and takes none back; leave them out",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(ID_BYTES)}"


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = Field(None, description="the served model's name (`GET /v1/models`); omitted = it")
    input: str | list[dict[str, Any]] | None = Field(None, description="a string (one user message) or items")
    instructions: str | None = Field(None, description="a system message before the input; not carried over")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: StopField = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    metadata: dict[str, str] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        """The refusals one field's type cannot express; raises InvalidRequestError naming the field."""
        if self.input is None and self.previous_response_id is None:
            raise InvalidRequestError("is required (or continue a stored response with previous_response_id)",
                                      param="input")  # fmt: skip
        if self.background:
            raise InvalidRequestError("background responses are not supported by this server", param="background")
        if self.conversation is not None:
            raise InvalidRequestError("the Conversations API is not supported; use previous_response_id",
                                      param="conversation")  # fmt: skip
        if self.truncation == "auto":
            raise InvalidRequestError("only 'disabled' is supported (a prompt past the context is refused)",
                                      param="truncation")  # fmt: skip
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            raise InvalidRequestError("is not supported by this server's models", param="reasoning")
        if self.top_logprobs:
            raise InvalidRequestError("is not supported on /v1/responses (only 0)", param="top_logprobs")
        stop_strings(self.stop)
        _check_metadata(self.metadata)

    def format(self) -> TextFormat:
        given = self.text.format if self.text is not None else None
        return given if given is not None else TextFormat.model_validate({})

    def text_config(self) -> dict[str, Any]:
        """`text` as the Response object echoes it."""
        fmt = self.format()
        shown: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            shown.update(name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description)
        return {"format": shown}

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (gateway.request.GatewayRequest), None for plain text."""
        fmt = self.format()
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise InvalidRequestError("is required for json_schema", param="text.format.schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequestError(f"key {quoted(key)} is over {MAX_METADATA_KEY_CHARS} characters",
                                      param="metadata")  # fmt: skip
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequestError(f"value of {quoted(key)} is over {MAX_METADATA_VALUE_CHARS} characters",
                                      param="metadata")  # fmt: skip


# -- tools ----------------------------------------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) as
    chat's (`{"type": "function", "function": {...}}`); any other tool type is refused by name."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(f"tool type {quoted(kind)} is not supported (only 'function')",
                                      param=f"tools[{i}].type")  # fmt: skip
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("is required: a function tool needs a name", param=f"tools[{i}].name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError("must be a JSON schema object", param=f"tools[{i}].parameters")
        function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = bool(tool["strict"])
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses `tool_choice` as chat's: the strings as they are, `{"type": "function", "name"}` as chat's
    named form; other forms (built-in tools, allowed_tools) refused."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise InvalidRequestError(f"{quoted(choice)} is not one of 'none', 'auto', 'required'",
                                      param="tool_choice")  # fmt: skip
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError("must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                              param="tool_choice")  # fmt: skip


def shown_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as the Response object echoes them."""
    return [
        {"type": "function", "name": tool["name"], "description": tool.get("description"),
         "parameters": tool.get("parameters") or {"type": "object", "properties": {}}, "strict": tool.get("strict")}
        for tool in tools or ()
    ]  # fmt: skip


# -- items ----------------------------------------------------------------------------------------------------


def input_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's `input` as normalised items (a string is one user message); InvalidRequestError names the
    item and field at fault."""
    if given is None:
        return []
    if isinstance(given, str):
        return [_message_item(new_id("msg"), "user", [{"type": "input_text", "text": given}])]
    if len(given) > MAX_ITEMS:
        raise InvalidRequestError(f"has {len(given)} items; at most {MAX_ITEMS}", param="input")
    return [_item(i, item) for i, item in enumerate(given)]


def _item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind in _UNSERVED_ITEMS:
        raise InvalidRequestError(_UNSERVED_ITEMS[kind], param=f"{where}.type")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(f"{quoted(role)} is not one of {', '.join(_ROLES)}", param=f"{where}.role")
        parts = _text_parts(item.get("content"), f"{where}.content", role)
        return _message_item(_id(item, "msg", where), role, parts)
    if kind == "function_call":
        call_id, name, arguments = (_string(item, field, where) for field in ("call_id", "name", "arguments"))
        return {"id": _id(item, "fc", where), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": "completed"}  # fmt: skip
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(part["text"] for part in _text_parts(output, f"{where}.output", "tool"))
        elif not isinstance(output, str):
            raise InvalidRequestError("must be a string or a list of text parts", param=f"{where}.output")
        return {"id": _id(item, "fco", where), "type": "function_call_output", "call_id": call_id,
                "output": output, "status": "completed"}  # fmt: skip
    raise InvalidRequestError(
        f"item type {quoted(kind)} is not supported (message, function_call, function_call_output)",
        param=f"{where}.type",
    )


def _message_item(item_id: str, role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    if role == "assistant":
        content = [{"type": "output_text", "text": p["text"], "annotations": [], "logprobs": []} for p in parts]
        return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": content}
    return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": parts}


def _text_parts(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError("must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = quoted(kind) if kind is not None else "without a type"
            raise InvalidRequestError(f"a part {shown} is not supported (text parts only: a text-only model)",
                                      param=f"{where}[{j}]")  # fmt: skip
        parts.append({"type": "input_text" if kind == "text" else kind, "text": part["text"]})
    return parts


def _string(item: dict[str, Any], field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise InvalidRequestError("is required, a string", param=f"{where}.{field}")
    return value


def _id(item: dict[str, Any], prefix: str, where: str) -> str:
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    if not isinstance(given, str) or not 0 < len(given) <= 128:
        raise InvalidRequestError("must be a string of 1-128 characters", param=f"{where}.id")
    return given


# -- the conversation as chat messages ----------------------------------------------------------------------

# Private keys of a stored output item (never shown to a client: `public`): the first item of a turn's output
# carries the model's whole output text, the turn's other items say they are part of it.
RAW = "_raw"
IN_RAW = "_in_raw"


def public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as the API shows it: without the store's private keys."""
    return {key: value for key, value in item.items() if not key.startswith("_")}


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for the chat template: `instructions` as the system message, then each item; an
    assistant's text and the function calls after it are one assistant message (as chat writes them), a
    function call's output a `tool` message. A turn this server generated is rendered from the model's own
    output text (its RAW key), so that a continued turn's prompt repeats it as the model wrote it."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    merge_calls = False  # the last message is an assistant's that a client's function calls extend
    for item in items:
        if RAW in item:
            messages.append({"role": "assistant", "content": item[RAW]})
            merge_calls = False
            continue
        if item.get(IN_RAW):
            continue
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": "".join(part["text"] for part in item["content"])})
            merge_calls = role == "assistant"
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if merge_calls:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                merge_calls = True
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            merge_calls = False
    return messages
