"""Tool calls read back out of a model's text: kvroute.tool_format's Hermes `<tool_call>` JSON.

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    ─► content "Let me look that up.", calls [ToolCall("call_…", "get_weather", '{"city": "Paris"}')]

Two readers of one grammar, free of any API's shapes (chat completions and the Responses API both use them):
`parse_tool_calls(text)` for a whole output, and `ToolCallParser` for a stream, fed text as it is detokenized.
`parse_tool_calls` is the parser fed the whole text at once, so the two agree wherever the text is split, with
one exception below.

The rules:
- A call is `<tool_call>`, a JSON object with a string `name` and an object `arguments`, `</tool_call>`. Its
  arguments are the model's own text of that object (so a stream's fragments add up to them).
- Whitespace between content and a call is dropped; other content is passed on as written.
- A block that is not a call (no name, JSON that does not parse) stays in the content as written, tags included,
  and so does a block left open at the end without a readable head.
- A stream commits to a call once its head, `{"name": "…", "arguments": {`, has arrived, and from then on sends
  the arguments as they come (OpenAI's chat deltas do the same). The exception: a block whose head is well
  formed but whose arguments turn out malformed is a call with those arguments in a stream, and content when
  the whole block is read at once. Under a forced tool choice the grammar makes every call well formed.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass

from kvroute.tool_format import TOOL_CALL_BEGIN, TOOL_CALL_END

# A call's head up to its arguments' opening brace (not consumed): what a stream commits on.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def new_call_id() -> str:
    """`call_` and 24 random hex digits (OpenAI's ids are `call_` and 24 characters)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object (as the model wrote it)


@dataclass(frozen=True)
class ToolCallDelta:
    """A stream's news about call `index` (0, 1, ... in the output's order): its first delta names it (`id`,
    `name`, `arguments` empty); later ones carry `arguments` fragments to append."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ParsedDelta:
    content: str  # text to append to the content
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedOutput:
    """A whole output's content and tool calls (the module's rules)."""
    parser = ToolCallParser()
    first, last = parser.feed(text), parser.finish()
    return ParsedOutput(first.content + last.content, parser.tool_calls)


class _State(enum.Enum):
    TEXT = "text"  # content, watching for TOOL_CALL_BEGIN
    HEAD = "head"  # inside a block, before its head is read
    ARGUMENTS = "arguments"  # inside a committed call, sending its arguments


class ToolCallParser:
    """Feed it an output's text piece by piece (`feed`), then `finish`; each returns what became known."""

    def __init__(self) -> None:
        self._state = _State.TEXT
        self._buffer = ""  # text received and not yet passed on
        self._held_space = ""  # whitespace before a block: dropped if it is a call, content if it is not
        self._after_call = False  # drop the whitespace that follows a call
        self._sent = ""  # the current call's arguments sent so far
        self._calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far (a call still streaming holds the arguments sent so far)."""
        return list(self._calls)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls):
            pass
        return ParsedDelta("".join(content), tuple(calls))

    def finish(self) -> ParsedDelta:
        """The end of the output: what was held back is passed on (an open block without a head as content,
        a call cut short with the arguments it has)."""
        delta = self.feed("")
        content, calls = [delta.content], list(delta.calls)
        if self._state is _State.TEXT:
            content.append(self._held_space + self._buffer)
        elif self._state is _State.HEAD:
            content.append(self._held_space + TOOL_CALL_BEGIN + self._buffer)
        else:  # cut short (max_tokens): without what began the end tag
            cut = self._buffer[: len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_END)]
            self._end_call(_final_arguments(cut), calls)
        self._buffer = self._held_space = ""
        self._state = _State.TEXT
        return ParsedDelta("".join(content), tuple(calls))

    # -- the machine -------------------------------------------------------------------------------------------

    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Advance as far as the buffer allows; True when the state changed (step again)."""
        if self._state is _State.TEXT:
            return self._text(content)
        if self._state is _State.HEAD:
            return self._head(content, calls)
        return self._arguments(calls)

    def _text(self, content: list[str]) -> bool:
        buffer = self._buffer
        if self._after_call:
            buffer = buffer.lstrip()
            self._after_call = not buffer
        start = buffer.find(TOOL_CALL_BEGIN)
        if start >= 0:
            before = buffer[:start]
            text = before.rstrip()
            content.append(self._held_space + text if text else "")
            self._held_space = before[len(text) :] if text else self._held_space + before
            self._buffer = buffer[start + len(TOOL_CALL_BEGIN) :]
            self._state = _State.HEAD
            return True
        # Hold back what may yet start a block: a partial tag, and the whitespace before it.
        ready = buffer[: len(buffer) - _partial_suffix(buffer, TOOL_CALL_BEGIN)].rstrip()
        if ready:
            content.append(self._held_space + ready)
            self._held_space = ""
        self._buffer = buffer[len(ready) :]
        return False

    def _head(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        buffer = self._buffer
        end = buffer.find(TOOL_CALL_END)
        if end >= 0:  # the whole block is here: read it whole
            block, self._buffer = buffer[:end], buffer[end + len(TOOL_CALL_END) :]
            self._state = _State.TEXT
            call = _read_block(block)
            if call is None:
                content.append(self._held_space + TOOL_CALL_BEGIN + block + TOOL_CALL_END)
                self._held_space = ""
                return True
            name, arguments = call
            self._start_call(name, calls)
            self._end_call(arguments, calls)
            return True
        head = _HEAD.match(buffer)
        called = None if head is None else _json_string(head.group(1))
        if head is None or called is None:
            return False  # not yet readable; read whole at the end tag
        self._start_call(called, calls)
        self._buffer = buffer[head.end() :]
        self._state = _State.ARGUMENTS
        return True

    def _arguments(self, calls: list[ToolCallDelta]) -> bool:
        buffer = self._buffer
        end = buffer.find(TOOL_CALL_END)
        if end >= 0:
            self._buffer = buffer[end + len(TOOL_CALL_END) :]
            self._end_call(_final_arguments(buffer[:end]), calls)
            self._state = _State.TEXT
            return True
        # Hold back what may be the call's closing brace, and a partial end tag.
        ready = buffer[: len(buffer) - _partial_suffix(buffer, TOOL_CALL_END)].rstrip()
        if ready.endswith("}"):
            ready = ready[:-1].rstrip()
        if len(ready) > len(self._sent) and ready.startswith(self._sent):
            calls.append(ToolCallDelta(len(self._calls) - 1, arguments=ready[len(self._sent) :]))
            self._sent = ready
            self._calls[-1] = ToolCall(self._calls[-1].id, self._calls[-1].name, ready)
        return False

    def _start_call(self, name: str, calls: list[ToolCallDelta]) -> None:
        call = ToolCall(new_call_id(), name, "")
        self._calls.append(call)
        calls.append(ToolCallDelta(len(self._calls) - 1, id=call.id, name=name))
        self._held_space = ""
        self._sent = ""

    def _end_call(self, arguments: str, calls: list[ToolCallDelta]) -> None:
        """The current call's arguments are `arguments` (whatever a stream already sent stays sent)."""
        call = self._calls[-1]
        if arguments.startswith(self._sent):
            if len(arguments) > len(self._sent):
                calls.append(ToolCallDelta(len(self._calls) - 1, arguments=arguments[len(self._sent) :]))
        else:
            arguments = self._sent
        self._calls[-1] = ToolCall(call.id, call.name, arguments)
        self._sent = ""
        self._after_call = True


def _read_block(block: str) -> tuple[str, str] | None:
    """(name, arguments text) of a whole block's JSON, or None when it is not a call."""
    head = _HEAD.match(block)
    if head is not None:
        name = _json_string(head.group(1))
        rest = block[head.end() :].rstrip()
        if name is not None and rest.endswith("}"):
            arguments = rest[:-1].rstrip()
            if _is_object(arguments):
                return name, arguments
    try:
        parsed = json.loads(block)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    given = parsed.get("arguments")
    if isinstance(given, str) and _is_object(given):
        return parsed["name"], given
    if isinstance(given, dict):
        return parsed["name"], json.dumps(given, ensure_ascii=False)
    return None


def _final_arguments(text: str) -> str:
    """A committed call's arguments from the text before its end tag (or the end of the output): less the
    call object's closing brace where the text has one."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (without being all of it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _json_string(body: str) -> str | None:
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
