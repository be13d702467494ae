"""A Generation as the Responses API's answer: the Response object, whole or as its stream of events.

The stream is OpenAI's sequence, each event an SSE `event:` line and its JSON with a `sequence_number` from 0:

    response.created, response.in_progress
    per output item: response.output_item.added
        a message:       response.content_part.added, response.output_text.delta..., response.output_text.done,
                         response.content_part.done
        a function call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed after an error)

Function calls come parsed from the model's text by the request path (gateway.tool_calls, when the request
offers tools); a message item opens at the first visible text and closes when a call's item opens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.request import Generation
from gateway.responses.wire import IN_RAW, RAW, new_id, public


@dataclass
class Turn:
    """What one generation produced, as it is known so far."""

    output: list[dict[str, Any]] = field(default_factory=list)  # the output items, in order
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: GatewayError | None = None


def usage_of(generation: Generation) -> dict[str, Any]:
    usage = generation.usage
    return {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: the prompt tokens this request computed (their full blocks join the prefix cache)
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens,
        },  # fmt: skip
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseRenderer:
    """One generation's Response: `whole()` or `events()`. `head` is the Response object's fixed fields (id,
    model, the echoed request); `finish(turn)` runs once the output is known, before the last event or the
    body (the endpoint stores the response there). `decode` spells the output's ids as the model's own text
    (tool-call markup included), which the store keeps for the next turn's prompt."""

    def __init__(
        self,
        generation: Generation,
        head: dict[str, Any],
        decode: Callable[[list[int]], str],
        finish: Callable[[Turn, dict[str, Any]], Any],
    ) -> None:
        self.generation = generation
        self.head = head
        self.decode = decode
        self.finish = finish

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {**self.head, "status": status, "output": output, **fields}

    def final(self, turn: Turn) -> dict[str, Any]:
        """The Response object once the generation ended."""
        public_output = [public(item) for item in turn.output]
        if turn.error is not None:
            error = {"code": "server_error", "message": turn.error.message}
            return self.response("failed", public_output, error=error, usage=None)
        incomplete = {"reason": "max_output_tokens"} if turn.finish_reason == "length" else None
        return self.response(
            "incomplete" if incomplete else "completed", public_output, incomplete_details=incomplete,
            usage=usage_of(self.generation), completed_at=time.time(),
        )  # fmt: skip

    async def whole(self) -> dict[str, Any]:
        turn = Turn()
        async for _ in self._items(turn):
            pass
        if turn.error is not None:
            raise turn.error
        body = self.final(turn)
        await self.finish(turn, body)
        return body

    async def events(self) -> AsyncGenerator[bytes, None]:
        sequence = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal sequence
            body = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

        opening = self.response("in_progress", [], usage=None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        turn = Turn()
        async for kind, fields in self._items(turn):
            yield event(kind, **fields)
        body = self.final(turn)
        if turn.error is None:
            await self.finish(turn, body)
        last = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"])
        yield event(last or "response.failed", response=body)

    async def _items(self, turn: Turn) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The output item events of the generation, filling `turn`; an error ends them and lands in `turn`.
        A chunk's text is the message's (tool-call markup already taken out by the request path); its
        `extra["tool_calls"]` are chat's call deltas: one with an `id` opens a call, the rest add arguments."""
        message: dict[str, Any] | None = None  # the open message item
        call: dict[str, Any] | None = None  # the open function call item
        content: list[str] = []  # the open message's text so far

        def added(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            turn.output.append(item)
            return "response.output_item.added", {"output_index": len(turn.output) - 1, "item": dict(item)}

        def open_message() -> list[tuple[str, dict[str, Any]]]:
            nonlocal message
            message = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                       "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ids = {"item_id": message["id"], "output_index": len(turn.output), "content_index": 0}
            return [added(message), ("response.content_part.added", {**ids, "part": part})]

        def close_message() -> list[tuple[str, dict[str, Any]]]:
            nonlocal message
            if message is None:
                return []
            done, message = message, None
            text = "".join(content)
            content.clear()
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done.update(content=[part], status="completed")
            index = turn.output.index(done)
            ids = {"item_id": done["id"], "output_index": index, "content_index": 0}
            return [
                ("response.output_text.done", {**ids, "text": text, "logprobs": []}),
                ("response.content_part.done", {**ids, "part": part}),
                ("response.output_item.done", {"output_index": index, "item": done}),
            ]

        def close_call() -> list[tuple[str, dict[str, Any]]]:
            nonlocal call
            if call is None:
                return []
            done, call = call, None
            done["status"] = "completed"
            index = turn.output.index(done)
            return [
                ("response.function_call_arguments.done",
                 {"item_id": done["id"], "output_index": index, "arguments": done["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": done}),
            ]  # fmt: skip

        def text_events(text: str) -> list[tuple[str, dict[str, Any]]]:
            if not text:
                return []
            events = [*close_call(), *(open_message() if message is None else [])]
            assert message is not None  # opened above
            content.append(text)
            delta = {"item_id": message["id"], "output_index": turn.output.index(message), "content_index": 0,
                     "delta": text, "logprobs": []}  # fmt: skip
            return [*events, ("response.output_text.delta", delta)]

        def call_events(delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
            nonlocal call
            events = []
            function = delta.get("function") or {}
            if delta.get("id"):
                events += [*close_message(), *close_call()]
                call = {"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                        "name": function.get("name") or "", "arguments": "", "status": "in_progress"}  # fmt: skip
                events.append(added(call))
            arguments = function.get("arguments") or ""
            if arguments and call is not None:
                call["arguments"] += arguments
                events.append(("response.function_call_arguments.delta",
                               {"item_id": call["id"], "output_index": turn.output.index(call),
                                "delta": arguments}))  # fmt: skip
            return events

        try:
            async for chunk in self.generation:
                if chunk.index != 0:
                    continue
                turn.output_ids.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    turn.finish_reason = chunk.finish_reason
                for event in text_events(chunk.text):
                    yield event
                for delta in chunk.extra.get("tool_calls", ()):
                    for event in call_events(delta):
                        yield event
        except GatewayError as exc:
            turn.error = exc
        finally:
            await self.generation.aclose()
        if not turn.output and turn.error is None:  # an empty answer is still the assistant's turn
            for event in open_message():
                yield event
        for event in [*close_message(), *close_call()]:
            yield event
        # The model's own text, where its ids came back (a kvroute worker): the next turn repeats it as written.
        # An HTTP engine sends text and parsed calls only: its items are rendered as chat writes them.
        if turn.output and turn.output_ids:
            turn.output[0][RAW] = self.decode(turn.output_ids)
            for item in turn.output[1:]:
                item[IN_RAW] = True
