"""The official `openai` Python client pointed at the gateway (a real `tiny` worker: a small random Llama with
SmolLM2's vocabulary, so the answers are real tokens): chat and completions, whole and streamed, with and
without include_usage, logprobs in both of OpenAI's shapes, and its error classes from our error bodies.

The client parses every response into its own types, so a field in the wrong place or a stream that does not
end properly fails here the way it fails for users.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from gateway_stack import KEY, SERVED_MODEL, GatewayStack, StackOptions, stack_fixture

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


stack = stack_fixture(StackOptions(model="tiny", workers=1, num_kv_blocks=64))


@pytest.fixture(scope="module")
def client(stack: GatewayStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=60) as opened:
        yield opened


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [SERVED_MODEL]
    assert client.models.retrieve(SERVED_MODEL).id == SERVED_MODEL


def test_chat(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert response.object == "chat.completion"
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert response.usage is not None and response.usage.completion_tokens == 4
    assert response.usage.prompt_tokens_details is not None
    assert isinstance(response.usage.prompt_tokens_details.cached_tokens, int), "never left null"
    raw = client.chat.completions.with_raw_response.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=1)
    assert raw.headers["x-kvroute-worker"] and raw.headers["x-kvroute-route"].startswith("policy=")


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream(client: openai.OpenAI, include_usage: bool) -> None:
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=4, temperature=0, stream=True, **options
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
        assert all(chunk.usage is None for chunk in chunks[:-1])
    else:
        assert all(chunk.usage is None for chunk in chunks)


def test_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(model=SERVED_MODEL, prompt="The capital of France is", max_tokens=4)
    assert response.object == "text_completion" and response.choices[0].text
    assert response.usage is not None and response.usage.completion_tokens == 4
    assert response.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream(client: openai.OpenAI, include_usage: bool) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=4, temperature=0)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(
        client.completions.create(
            model=SERVED_MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True, **options
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    else:
        assert all(chunk.usage is None for chunk in chunks)


def test_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= 0 and entry.bytes
        assert entry.token == entry.top_logprobs[0].token, "greedy: the chosen token is the most likely"
    completion = client.completions.create(
        model=SERVED_MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 3
    assert all(
        len(top) >= 2 and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )


def test_errors_map_to_the_clients_exception_classes(client: openai.OpenAI, stack: GatewayStack) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=1)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=1, temperature=-1)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=SERVED_MODEL, prompt="hello " * 400, max_tokens=200)
    assert too_long.value.code == "context_length_exceeded"
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="sk-wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model=SERVED_MODEL, prompt="hi", max_tokens=1)
