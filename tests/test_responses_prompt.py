"""A continued turn's prompt (gateway/responses/prompt.py) on SmolLM2's tokenizer and template: the previous
prompt and the sampled output ids, token for token, across turns, even when the output's text encodes to other
ids; the rendering as it is when the conversation changed; an engine's turn (no ids) kept as chat writes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.request import Chunk, Generation, RouteInfo, Usage
from gateway.responses.prompt import continued_prompt
from gateway.responses.render import ResponseRenderer, Turn
from gateway.responses.wire import IN_RAW, RAW, chat_messages
from kvroute.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}


def _spelled_otherwise(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s ids as a model may sample them: one token a character, not the tokenizer's merges."""
    ids = [i for character in text for i in tokenizer.encode(character)]
    assert ids != tokenizer.encode(text) and tokenizer.decode(ids) == text
    return ids


def test_turns_extend_each_other_token_for_token(tokenizer_smollm2: Tokenizer) -> None:
    tok = tokenizer_smollm2
    eos = tok.encode_chat([SYSTEM, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
    end_of_turn = next(i for i in reversed(eos) if i in tok.special_token_ids)
    messages = [SYSTEM, {"role": "user", "content": "Hello there."}]
    prompt = tok.encode_chat(messages)
    for turn in range(3):
        answer = f"Answer number {turn}, with words."
        output = [*_spelled_otherwise(tok, answer), end_of_turn]
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"More {turn}"}]
        rendered = tok.encode_chat(messages)
        following = continued_prompt(rendered, prompt, output, tok)
        assert following[: len(prompt) + len(output) - 1] == [*prompt, *output[:-1]]
        assert following[len(prompt) + len(output) - 1] == end_of_turn
        assert tok.decode(following) == tok.decode(rendered) and following != rendered
        prompt = following


def test_a_changed_conversation_is_sent_as_rendered(tokenizer_smollm2: Tokenizer) -> None:
    tok = tokenizer_smollm2
    first = [SYSTEM, {"role": "user", "content": "Hello there."}]
    prompt = tok.encode_chat(first)
    output = _spelled_otherwise(tok, "Hi.")
    other_instructions = [{"role": "system", "content": "Be verbose."}, *first[1:]]
    rendered = tok.encode_chat([*other_instructions, {"role": "assistant", "content": "Hi."},
                                {"role": "user", "content": "And?"}])  # fmt: skip
    assert continued_prompt(rendered, prompt, output, tok) == rendered
    rewritten = tok.encode_chat([*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "?"}])
    assert continued_prompt(rewritten, prompt, output, tok) == rewritten  # the answer is not what was sampled
    assert continued_prompt(rendered, [], output, tok) == rendered


class _EngineAnswer(Generation):
    """An HTTP engine's answer as the request path gives it: text and parsed call deltas, no token ids."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.request_id, self.route, self.prompt_token_ids = "e", RouteInfo("w", "a", "p", "r"), []
        self.usage = Usage()
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        return


def test_an_engines_tool_calls_are_kept_for_the_next_turn(tokenizer_smollm2: Tokenizer) -> None:
    """Without the model's ids there is no model text to repeat: the stored turn is the message and its calls,
    and the next turn's chat carries the calls (it once kept the text alone and lost them)."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    answer = _EngineAnswer(
        [Chunk(0, "Looking.", extra={"tool_calls": [call]}), Chunk(0, "", finish_reason="tool_calls")]
    )
    turns: list[Turn] = []

    async def finish(turn: Turn, body: dict) -> None:
        turns.append(turn)

    renderer = ResponseRenderer(answer, {"id": "resp_x", "created_at": 0.0}, tokenizer_smollm2.decode, finish)
    asyncio.run(renderer.whole())
    (turn,) = turns
    assert [item["type"] for item in turn.output] == ["message", "function_call"]
    assert not any(RAW in item or IN_RAW in item for item in turn.output)
    assistant = chat_messages(None, turn.output)[0]
    assert assistant["content"] == "Looking."
    assert assistant["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
