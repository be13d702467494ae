"""The OpenAI-compatible wire format, in one module (as vLLM's entrypoints/openai/protocol.py): the request
bodies the gateway accepts, the responses and stream chunks it sends, and the translation of a request into
the gateway's one internal type (`gateway.request.GatewayRequest`).

Requests are validated strictly (a string is not a number, a float is not an integer, NaN is refused) and
every refusal is an `InvalidRequestError` whose `param` names the field (`messages[2].role`), never a
pydantic dump. Fields that OpenAI or vLLM define but this server cannot honour (penalties, logit_bias,
echo, image parts, ...) are refused with a clear 400 rather than silently ignored; fields nobody defines are
ignored, as vLLM does, because clients send their own extensions.

The response models document the shapes for the OpenAPI schema and for tests; the server itself builds the
same shapes as plain dicts (gateway.frontdoors.http_server), which is several times faster on the hot path.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import InvalidRequestError, quoted
from gateway.request import PRIORITY_RANGE, GatewayRequest
from kvroute.sampling import MAX_TOP_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_REQUEST_ID_CHARS = 128

TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
StopField = Annotated[
    str | list[str] | None,
    Field(description="a string or a list of strings; generation stops before the first match (not returned)"),
]


class OpenAIModel(BaseModel):
    """Strict JSON types, finite numbers, unknown fields ignored (clients send their own extensions)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


M = TypeVar("M", bound=OpenAIModel)


class StreamOptions(OpenAIModel):
    include_usage: bool = Field(False, description="send one last chunk with `choices: []` and the usage")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The `stop` field as a tuple; InvalidRequestError naming an empty string (it would match everywhere)."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    for i, text in enumerate(strings):
        if not text:
            raise InvalidRequestError(
                "must not be an empty string", param="stop" if isinstance(stop, str) else f"stop[{i}]"
            )
    return strings


class SamplingFields(OpenAIModel):
    """The sampling fields common to both endpoints."""

    model: str | None = Field(None, description="the served model's name (`GET /v1/models`); omitted = it")
    temperature: float | None = Field(None, ge=0, description=">= 0; 0 is greedy. Default 1")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass, in (0, 1]. Default 1")
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="sample among the k most likely; 0 or -1 = off")
    n: int = Field(1, ge=1, le=INT32_MAX, description="independent choices for the prompt (up to the server's limit)")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="seed of this request's sampler")
    stop: StopField = None
    stop_token_ids: list[TokenId] | None = Field(None, description="stop after sampling any of these token ids")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="the end user; the `session` policy's key without x-session-id")
    presence_penalty: float | None = Field(None, description="not supported: only 0")
    frequency_penalty: float | None = Field(None, description="not supported: only 0")
    repetition_penalty: float | None = Field(None, description="not supported: only 1")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: only empty")
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token (vLLM)")
    min_tokens: int = Field(
        0, ge=0, le=INT32_MAX, description="no end-of-sequence or stop token before this many output tokens (vLLM)"
    )
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text (vLLM)")
    cache_salt: str | None = Field(
        None, description="isolates this client's cached prefixes (vLLM); mixed in under the tenant's own salt"
    )
    priority: int | None = Field(
        None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
        description="lower is served first (vLLM); x-kvroute-priority wins; never above the tenant's ceiling",
    )  # fmt: skip

    def _check_common(self) -> None:
        """Refusals that one field's type cannot express; raises InvalidRequestError naming the field."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise InvalidRequestError(f"is not supported by this server (only {neutral:g})", param=name)
        if self.logit_bias:
            raise InvalidRequestError("is not supported by this server (only an empty map)", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("is only allowed when stream is true", param="stream_options")
        stop_strings(self.stop)

    def _gateway_request(
        self,
        headers: RequestHeaders,
        max_tokens: int | None,
        default_max_tokens: int,
        logprobs: bool,
        top_logprobs: int,
        **fields: Any,
    ) -> GatewayRequest:
        """`max_tokens`: the client's; None takes `default_max_tokens` (and marks the request so)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        stop = stop_strings(self.stop)
        return GatewayRequest(
            api_key=headers.api_key,
            model=self.model,
            params=params,
            max_tokens_defaulted=max_tokens is None,
            stop=stop,
            n=self.n,
            session_id=headers.session_id or self.user,
            app=headers.app,
            client_cache_salt=self.cache_salt or "",
            priority=self.priority if headers.priority is None else headers.priority,
            skip_special_tokens=self.skip_special_tokens,
            stream=self.stream,
            trace_context=headers.trace_context,
            **fields,
        )

    def to_gateway_request(self, headers: RequestHeaders, default_max_tokens: int | None = None) -> GatewayRequest:
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


@dataclasses.dataclass(frozen=True)
class RequestHeaders:
    """What the gateway reads from a request's headers (or a gRPC call's metadata)."""

    api_key: str | None = None  # Authorization: Bearer <key>
    session_id: str | None = None  # x-session-id
    app: str | None = None  # x-kvroute-app
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # traceparent, tracestate
    priority: int | None = None  # x-kvroute-priority (priority_header checks it)


PRIORITY_HEADER = "x-kvroute-priority"


def priority_header(value: str | None) -> int | None:
    """The x-kvroute-priority header's integer (None when absent); InvalidRequestError naming the header for a
    value that is not an integer in PRIORITY_RANGE."""
    if value is None:
        return None
    text = value.strip()
    digits = text[1:] if text[:1] in ("+", "-") else text
    if digits.isascii() and digits.isdigit() and len(digits) <= 7:
        priority = int(text)
        if PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            return priority
    low, high = PRIORITY_RANGE
    raise InvalidRequestError(f"must be an integer in [{low}, {high}], got {quoted(value)}", param=PRIORITY_HEADER)


def bearer_token(authorization: str | None) -> str | None:
    """The key of `Bearer <key>` (scheme case-insensitive); any other value is passed on as given, so a
    malformed header fails authentication (401) rather than being treated as no key at all."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else authorization


def client_request_id_of(value: str | None) -> str | None:
    """The client's x-request-id when it is a sane token to echo (printable ASCII, at most
    MAX_REQUEST_ID_CHARS), else None (the gateway's own id is sent instead)."""
    if value and len(value) <= MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return None


# -- /v1/completions -----------------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="a string, or token ids; one prompt per request (a list of one string is accepted)"
    )
    max_tokens: int | None = Field(
        COMPLETION_DEFAULT_MAX_TOKENS, ge=1, le=INT32_MAX, description="tokens to generate at most. Default 16"
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="return each token's logprob and this many alternatives"
    )
    echo: bool = Field(False, description="not supported: only false")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="not supported beyond n")

    def to_gateway_request(self, headers: RequestHeaders, default_max_tokens: int | None = None) -> GatewayRequest:
        """The internal request; raises InvalidRequestError naming the field. `default_max_tokens` is unused
        here (completions default to 16 tokens, as OpenAI's do); it keeps both request types callable alike."""
        self._check_common()
        if self.echo:
            raise InvalidRequestError("is not supported by this server (only false)", param="echo")
        if self.suffix:
            raise InvalidRequestError("is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("is not supported by this server (only equal to n)", param="best_of")
        text, token_ids = _one_prompt(self.prompt)
        return self._gateway_request(
            headers,
            max_tokens=self.max_tokens if "max_tokens" in self.model_fields_set else None,
            default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            prompt=text,
            prompt_token_ids=token_ids,
            kind="completion",
        )


def _one_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif not prompt:
        raise InvalidRequestError("is empty; send a string or at least one token id", param="prompt")
    elif len(prompt) > 1 and not isinstance(prompt[0], int):
        raise InvalidRequestError(
            f"has {len(prompt)} prompts; this server takes one prompt per request", param="prompt"
        )
    elif isinstance(prompt[0], str):
        text, ids = prompt[0], None
    elif isinstance(prompt[0], list):
        text, ids = None, prompt[0]
    else:
        text, ids = None, list(prompt)
    if text == "" or ids == []:
        raise InvalidRequestError("is empty; send a string or at least one token id", param="prompt")
    return text, ids


# -- /v1/chat/completions ------------------------------------------------------------------------------------


class ContentPart(OpenAIModel):
    """One part of a message's content. Only `{"type": "text", "text": ...}` is served; image, audio and file
    parts are refused by name (a text-only model)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, description="a string or a list of text parts")
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's earlier tool calls")
    tool_call_id: str | None = Field(None, description="for role `tool`: the call this message answers")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(
        description="the conversation so far, at least one message", json_schema_extra={"minItems": 1}
    )
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=INT32_MAX, description="tokens to generate at most; default: the server's limit"
    )
    logprobs: bool = Field(False, description="return each generated token's logprob in choices[].logprobs")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many alternatives per token"
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description='function tools, `{"type": "function", "function": {"name", "description", "parameters"}}`'
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="`none`, `auto` (the default with tools), `required`, or a named function (forced by grammar)"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call. Default true")
    response_format: dict[str, Any] | None = Field(
        None, description="`text`, `json_object` or `json_schema` (with json_schema.schema): the output is constrained"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn opening (vLLM)")

    def to_gateway_request(self, headers: RequestHeaders, default_max_tokens: int | None = None) -> GatewayRequest:
        """The internal request; raises InvalidRequestError naming the field. Without max_completion_tokens
        (or max_tokens) the request asks for `default_max_tokens` (the server's limit; the request path
        bounds it by the context that is left)."""
        self._check_common()
        if not self.messages:
            raise InvalidRequestError("is empty; send at least one message", param="messages")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("needs logprobs: true", param="top_logprobs")
        messages = [_template_message(i, message) for i, message in enumerate(self.messages)]
        template_kwargs = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
        return self._gateway_request(
            headers,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            messages=messages,
            template_kwargs=template_kwargs,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=self.response_format,
            kind="chat",
        )


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """The message as the chat template reads it: content as one string (text parts joined by newlines, as
    vLLM does), other fields only when set."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise InvalidRequestError(
                    f"{quoted(part.type)} parts are not supported: this model reads text only",
                    param=f"messages[{index}].content[{j}].type",
                )
            if part.text is None:
                raise InvalidRequestError("is required for a text part", param=f"messages[{index}].content[{j}].text")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is None and not message.tool_calls:
        raise InvalidRequestError("is required (a string or a list of text parts)", param=f"messages[{index}].content")
    if message.role == "tool" and message.tool_call_id is None:
        raise InvalidRequestError("is required for role 'tool'", param=f"messages[{index}].tool_call_id")
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    for name in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, name)
        if value is not None:
            out[name] = value
    return out


# -- /tokenize and /detokenize (vLLM's, also served by SGLang at the same paths) ------------------------------


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize body: either a `prompt` (its TokenizeCompletionRequest) or `messages` (its
    TokenizeChatRequest), with their fields and defaults. The ids are the ones a generation request with the
    same prompt or messages is sent with (gateway.request_path.RequestPath.tokenize)."""

    model: str | None = Field(None, description="the served model's name; omitted = it")
    prompt: str | None = Field(None, description="a text, tokenized as a completion's prompt")
    messages: list[ChatMessage] | None = Field(None, description="a conversation, rendered as a chat's prompt")
    add_special_tokens: bool | None = Field(
        None, description="add the tokenizer's special tokens (a BOS); default true for a prompt, false for messages"
    )
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="not supported: only false")
    return_token_strs: bool = Field(False, description="also return each token's string (`token_strs`)")
    tools: list[dict[str, Any]] | None = Field(None, description="messages: tool definitions for the template")
    chat_template: str | None = Field(None, description="not supported: the model's own template is used")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="not supported: a text-only model")

    def to_gateway_request(self, headers: RequestHeaders) -> GatewayRequest:
        """The internal request of the prompt or messages; raises InvalidRequestError naming the field."""
        for name in ("chat_template", "mm_processor_kwargs"):
            if getattr(self, name) is not None:
                raise InvalidRequestError("is not supported by this server", param=name)
        if self.continue_final_message:
            raise InvalidRequestError("is not supported by this server (only false)", param="continue_final_message")
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send exactly one of prompt and messages", param="prompt")
        request = functools.partial(
            GatewayRequest, api_key=headers.api_key, model=self.model, add_special_tokens=self.add_special_tokens
        )
        if self.prompt is not None:
            return request(prompt=self.prompt, kind="completion")
        assert self.messages is not None
        if not self.messages:
            raise InvalidRequestError("is empty; send at least one message", param="messages")
        template_kwargs = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
        messages = [_template_message(i, message) for i, message in enumerate(self.messages)]
        return request(messages=messages, template_kwargs=template_kwargs, tools=self.tools, kind="chat")


class TokenizeResponse(BaseModel):
    count: int = Field(description="how many token ids")
    max_model_len: int = Field(description="the longest sequence (prompt and output) the serving workers take")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="each token's string, with return_token_strs")


class DetokenizeRequest(OpenAIModel):
    model: str | None = Field(None, description="the served model's name; omitted = it")
    tokens: list[TokenId] = Field(description="token ids, special tokens included in the text")


class DetokenizeResponse(BaseModel):
    prompt: str


# -- parsing ---------------------------------------------------------------------------------------------------

_FIELD_NAMES = frozenset(
    name
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        ContentPart,
        StreamOptions,
        TokenizeRequest,
        DetokenizeRequest,
    )  # fmt: skip
    for name in model.model_fields
)


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; raises InvalidRequestError naming the first field at fault."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid_request(exc, body, _FIELD_NAMES | _field_names(model)) from None


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The names (aliases included) of `model`'s fields and of the models nested in them."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or name)
        stack = [info.annotation]
        while stack:
            annotation = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                names |= _field_names(annotation)
            else:
                stack.extend(typing.get_args(annotation))
    return frozenset(names)


def _invalid_request(exc: ValidationError, body: bytes, field_names: frozenset[str]) -> InvalidRequestError:
    error = exc.errors(include_url=False)[0]
    if error["type"] == "json_invalid":
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            return InvalidRequestError(f"request body is not valid UTF-8 (byte {bad.start})")
        return InvalidRequestError(f"request body is not valid JSON: {error['msg'].removeprefix('Invalid JSON: ')}")
    if not error["loc"]:
        return InvalidRequestError("request body must be a JSON object")
    param, union_member = _param_of(error["loc"], field_names)
    if error["type"] == "missing":
        return InvalidRequestError("is required", param=param)
    if union_member:
        # A field with several accepted shapes: pydantic reports one failure per shape; name the field and
        # what it accepts instead.
        expected = _description_of(param)
        return InvalidRequestError(f"has the wrong type{'; expected ' + expected if expected else ''}", param=param)
    value = error.get("input")
    shown = "" if isinstance(value, dict | list) else f", got {quoted(value)}"
    return InvalidRequestError(f"{_must(error['msg'])}{shown}", param=param)


def _param_of(loc: tuple[int | str, ...], field_names: frozenset[str]) -> tuple[str, bool]:
    """`('messages', 2, 'role')` -> `messages[2].role`; stops at a union member's tag (`'list[int]'`) and says so."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in field_names:
            param += f".{part}" if param else part
        else:
            return param, True
    return param, False


def _description_of(param: str) -> str | None:
    leaf = param.rsplit(".", 1)[-1].split("[", 1)[0]
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage):
        field = model.model_fields.get(leaf)
        if field is not None and field.description:
            return field.description
    return None


def _must(message: str) -> str:
    """pydantic's "Input should be greater than 0" as "must be greater than 0"."""
    return message.replace("Input should be", "must be", 1) if message.startswith("Input should") else message


# -- responses (documentation and tests; the server builds these shapes as dicts) ---------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens the worker served from its prefix cache")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(description="always set on a response; in a stream, only on the last chunk")


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text (an object)")


class ToolCallOut(BaseModel):
    id: str = Field(description="`call_` and 24 random characters")
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the message is tool calls only")
    tool_calls: list[ToolCallOut] | None = Field(None, description="with tools: the calls parsed from the output")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDeltaOut(BaseModel):
    """A call's first delta has its id, type and name (arguments empty); later ones append to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a chat stream: the first per choice carries `delta.role`; with include_usage
    every chunk has `usage: null` and one last chunk has `choices: []` and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ErrorDetail(BaseModel):
    message: str = Field(description="starts with the field at fault when there is one: `top_p: must be ...`")
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the model served under this name (vLLM's)")
    parent: str | None = None
    max_model_len: int = Field(description="the longest sequence the serving workers take (vLLM's)")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
