"""Workloads rendered to text for `kvroute bench`: what the replay simulates as token ids, sent as real
prompts to a live fleet.

Token ids become words: each id maps to one word that the model's tokenizer encodes as exactly one token
with its leading space (`" harbor"`), so a rendered prompt of n ids is n tokens, and equal token-id
prefixes give equal text prefixes, hence equal token prefixes again on the server (the pre-tokenizer
splits at every space, so a word never merges with its neighbour).

Sources (`--workload`):
  NAME         a synthetic workload of sim.workloads (`synthetic:NAME` is accepted too), one
               `/v1/completions` prompt per request. A request whose trace carries a known answer
               (multi-turn chat, agents) follows the previous request of its session: the bench sends
               it only after that one finished, as a user would.
  chat         multi-turn chat sessions as `/v1/chat/completions` messages: one 1,000-token system
               prompt shared by every session, 100-token questions, 300-token answers, 8 turns. Each
               turn resends the whole conversation. Its assistant messages are the logged answers; the
               bench replaces them with the answers the fleet streamed (closed-loop sessions, its
               default), so a turn carries the tokens its session's worker decoded last turn. Every turn
               (the first too: the user types the question) is sent `think_s` after the session's
               previous answer finished or its schedule allows, whichever is later: exponential with
               mean `think_ms`, drawn from the seed, so every router gets the same pauses. The
               schedule (`arrival_s`) starts sessions 250 ms apart on average, turns 10 s apart.
  agent        agent sessions, as chat messages: a system prompt of tool definitions (AGENT_TOOLS function
               tools written out in single-token words, ~1,200 tokens, the same for every session, as an
               agent framework puts its tools there), an 80-token task, then turns that each append,
               after the model's 100-token answer, a `user` message holding a tool's 200-token result
               (led by the fixed words ` tool response`, the `<tool_response>` tag's run); 6 turns.
               Closed-loop with think times as `chat` (the same renderer with another shape); sent as
               chat messages, or through `/v1/responses` with `previous_response_id` (`--api responses`).
               Not the replay's `agents` (completion prompts of a token-id trace).
  trace:FILE   a Mooncake trace: one fixed block of text per hash id (seeded by the id, so equal ids give
               equal text), `block_tokens` words each (512 as in Mooncake; fewer scales the whole trace
               down, output lengths too, so a CPU fleet can serve it); the last block of a prompt is the
               prefix of its id's block that the input length asks for.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any

from kvroute.hashing import DEFAULT_BLOCK_SIZE
from kvroute.model_source import resolve_model, smollm2_gguf_path
from kvroute.tokenizer import Tokenizer
from sim.traces import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest, read_mooncake
from sim.workloads import WORKLOAD_NAMES, WorkloadError, generate
from worker.sim_words import single_token_words

TRACE_PREFIX = "trace:"
SYNTHETIC_PREFIX = "synthetic:"
CHAT = "chat"
CHAT_SYSTEM_TOKENS = 1000
CHAT_QUESTION_TOKENS = 100
CHAT_ANSWER_TOKENS = 300
CHAT_TURNS = 8
CHAT_DEFAULT_REQUESTS = 256
CHAT_MEAN_GAP_MS = 250.0  # between session starts
CHAT_ANSWER_MS = 10_000.0  # the schedule's gap between a session's turns (the bench waits for the answer instead)
CHAT_THINK_MS = 5_000.0  # mean think time before each turn (see the module docstring)
AGENT = "agent"
AGENT_TOOLS = 8  # function tools in the system prompt, 150 tokens each (tool_preamble)
AGENT_TASK_TOKENS = 80
AGENT_TOOL_OUTPUT_TOKENS = 200
AGENT_ANSWER_TOKENS = 100
AGENT_TURNS = 6
AGENT_DEFAULT_REQUESTS = 96
TOOL_OUTPUT_LEAD = " tool response"  # the words every tool output starts with


class RenderError(ValueError):
    """A workload that cannot be rendered: an unknown name, a bad size, a trace that cannot be read."""


@dataclass(frozen=True)
class BenchRequest:
    """One request as the bench sends it: a completion `prompt` or chat `messages` (exactly one is set)."""

    index: int
    arrival_s: float  # the workload's own arrival time, from its start
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    session: str | None = None
    after: int | None = None  # index of the request this one follows (its session's previous turn)
    cache_salt: str = ""
    think_s: float = 0.0  # the pause before sending, after the previous turn finished or the schedule allows
    tenant: str | None = None  # who sends it (loadtest.traffic_mix): its API key, or its cache salt to a peer
    band: str | None = None  # its priority band's name (loadtest.traffic_mix)
    priority: int | None = None  # the body's `priority`, as vLLM takes it: lower is more urgent
    previous_response_id: str | None = None  # the Responses API's id of the turn this one continues, once known

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


@dataclass(frozen=True)
class Workload:
    """Rendered requests, in arrival order, and the token-id trace they came from (for the replay)."""

    name: str
    requests: tuple[BenchRequest, ...]
    trace: Trace = field(repr=False)


class Vocabulary:
    """Token id -> a word that is one token of the tokenizer with its leading space (worker.sim_words: the
    words `sim` workers answer in)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = [word.text for word in single_token_words(tokenizer)]
        if len(self.words) < 1000:
            raise RenderError(f"the tokenizer has only {len(self.words)} single-token words; need 1,000 or more")

    def text(self, token_ids: Sequence[int]) -> str:
        words = self.words
        return "".join(words[t % len(words)] for t in token_ids)

    def word_ids(self, text: str) -> list[int]:
        """The ids that render to `text`, a run of space-led single-token words (`" tool response"`)."""
        index = self._index
        try:
            return [index[" " + word] for word in text.split()]
        except KeyError as exc:
            raise RenderError(f"{exc.args[0]!r} is not a single-token word of this tokenizer") from None

    @cached_property
    def _index(self) -> dict[str, int]:
        return {word: i for i, word in enumerate(self.words)}


@lru_cache(maxsize=4)
def vocabulary(model: str = "smollm2") -> Vocabulary:
    """The vocabulary of a model spec's tokenizer (`tiny` and `sim` share SmolLM2's)."""
    try:
        source = resolve_model(model)
        if source.path is None:  # tiny and sim
            tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
        elif source.kind == "hf":
            tokenizer = Tokenizer.from_hf_dir(source.path)
        else:
            tokenizer = Tokenizer.from_gguf(source.path)
    except (ValueError, FileNotFoundError) as exc:
        raise RenderError(str(exc)) from None
    return Vocabulary(tokenizer)


def workload_names() -> tuple[str, ...]:
    return (*WORKLOAD_NAMES, CHAT, AGENT, f"{TRACE_PREFIX}FILE")


def render(
    name: str,
    requests: int | None = None,
    seed: int = 0,
    model: str = "smollm2",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    think_ms: float = CHAT_THINK_MS,
) -> Workload:
    """Render workload `name` (see the module docstring); the first `requests` of it when given. `think_ms`
    is `chat`'s and `agent`'s mean think time before a turn (0: none)."""
    if requests is not None and requests < 1:
        raise RenderError(f"requests must be >= 1, got {requests}")
    if not (think_ms >= 0 and math.isfinite(think_ms)):
        raise RenderError(f"think time must be >= 0 ms, got {think_ms}")
    vocab = vocabulary(model)
    if name.startswith(TRACE_PREFIX):
        return render_mooncake(name.removeprefix(TRACE_PREFIX), vocab, requests, block_tokens)
    name = name.removeprefix(SYNTHETIC_PREFIX)
    if name == CHAT:
        return render_chat(vocab, requests or CHAT_DEFAULT_REQUESTS, seed, think_ms=think_ms)
    if name == AGENT:
        return render_agent(vocab, requests or AGENT_DEFAULT_REQUESTS, seed, think_ms=think_ms)
    try:
        trace = generate(name, requests, seed=seed, block_size=block_size)
    except WorkloadError as exc:
        raise RenderError(f"workload: {exc}; or {CHAT}, {AGENT}, or {TRACE_PREFIX}FILE") from None
    return render_token_trace(trace, vocab)


def render_token_trace(trace: Trace, vocab: Vocabulary) -> Workload:
    """Completion prompts for a token-id trace; a request follows its session's previous one when that one
    carries a known answer (the conversation continues from it)."""
    last_of_session: dict[str, int] = {}
    out = []
    for i, req in enumerate(trace.requests):
        after = None
        if req.session_id is not None:
            previous = last_of_session.get(req.session_id)
            if previous is not None and trace.requests[previous].output_token_ids:
                after = previous
            last_of_session[req.session_id] = i
        out.append(
            BenchRequest(
                i,
                req.arrival_ms / 1e3,
                max(req.output_length, 1),
                prompt=vocab.text(req.token_ids),
                session=req.session_id,
                after=after,
                cache_salt=req.cache_salt,
            )
        )
    return Workload(trace.name, tuple(out), trace)


@dataclass(frozen=True)
class SessionShape:
    """The shape of a workload's conversations (render_sessions): `turns` a session; the first user message
    `first_user_tokens` long, each later one `user_tokens` long and led by the words `user_lead` (ids); each
    logged answer `answer_tokens` long."""

    name: str
    turns: int
    first_user_tokens: int
    user_tokens: int
    answer_tokens: int
    user_lead: tuple[int, ...] = ()


def render_chat(
    vocab: Vocabulary, n: int, seed: int, turns: int = CHAT_TURNS, think_ms: float = CHAT_THINK_MS
) -> Workload:
    """`n` chat turns in sessions of `turns` (see the module docstring)."""
    shape = SessionShape(CHAT, turns, CHAT_QUESTION_TOKENS, CHAT_QUESTION_TOKENS, CHAT_ANSWER_TOKENS)
    return render_sessions(vocab, n, seed, shape, lambda draw: draw(CHAT_SYSTEM_TOKENS), think_ms)


def render_agent(vocab: Vocabulary, n: int, seed: int, think_ms: float = CHAT_THINK_MS) -> Workload:
    """`n` agent turns in sessions of AGENT_TURNS (see the module docstring)."""
    shape = SessionShape(
        AGENT, AGENT_TURNS, AGENT_TASK_TOKENS, AGENT_TOOL_OUTPUT_TOKENS, AGENT_ANSWER_TOKENS,
        tuple(vocab.word_ids(TOOL_OUTPUT_LEAD)),
    )  # fmt: skip
    return render_sessions(vocab, n, seed, shape, partial(tool_preamble, vocab), think_ms)


def tool_preamble(vocab: Vocabulary, draw: Callable[[int], list[int]]) -> list[int]:
    """AGENT_TOOLS function tools as an agent's system prompt lists them, in single-token words, 150 ids each:
    ` function name NAME description` and 40 words, ` parameters` and four of them (` name P type string|integer
    description` and 20 words), ` required` and the four names. The names and texts are `draw`n."""
    word = vocab.word_ids
    types = (word(" string"), word(" integer"))
    ids: list[int] = []
    for _ in range(AGENT_TOOLS):
        ids += [*word(" function name"), *draw(1), *word(" description"), *draw(40), *word(" parameters")]
        parameters = draw(4)
        for parameter in parameters:
            ids += [*word(" name"), parameter, *word(" type"), *types[parameter % 2], *word(" description"), *draw(20)]
        ids += [*word(" required"), *parameters]
    return ids


def render_sessions(
    vocab: Vocabulary,
    n: int,
    seed: int,
    shape: SessionShape,
    system: Callable[[Callable[[int], list[int]]], list[int]],
    think_ms: float = CHAT_THINK_MS,
) -> Workload:
    """`n` turns of conversations of `shape`, each a system prompt (`system(draw)`, drawn once: every session
    shares it), then user and assistant messages, with the token-id trace the replay simulates for them (the
    logged answer is the one the replay's cache keeps). `draw(k)` gives k ids from the seeded generator that
    draws everything else. The token ids do not depend on `think_ms`."""
    rng = random.Random(seed)

    def draw(count: int) -> list[int]:
        return [rng.randrange(1, 32_000) for _ in range(count)]

    system_ids = system(draw)
    turns_out: list[_Turn] = []
    start_ms = 0.0
    for session in range(-(-n // shape.turns)):
        at, history = start_ms, list(system_ids)
        messages: list[dict[str, str]] = [{"role": "system", "content": vocab.text(system_ids)}]
        for turn in range(min(shape.turns, n - len(turns_out))):
            if turn == 0:
                question = draw(shape.first_user_tokens)
            else:
                question = [*shape.user_lead, *draw(shape.user_tokens - len(shape.user_lead))]
            answer = draw(shape.answer_tokens)
            think_s = think_ms * rng.expovariate(1.0) / 1e3
            messages = [*messages, {"role": "user", "content": vocab.text(question)}]
            prompt = history + question
            name = f"{shape.name}-{session}"
            token_request = TraceRequest(
                at, len(prompt), len(answer), token_ids=tuple(prompt), output_token_ids=tuple(answer), session_id=name
            )
            turns_out.append(_Turn(at, session, turn, tuple(messages), token_request, round(think_s, 6)))
            messages = [*messages, {"role": "assistant", "content": vocab.text(answer)}]
            history = prompt + answer
            at = round(at + CHAT_ANSWER_MS, 3)
        start_ms += rng.expovariate(1 / CHAT_MEAN_GAP_MS)
    turns_out.sort(key=lambda t: (t.at_ms, t.session, t.turn))
    index = {(t.session, t.turn): i for i, t in enumerate(turns_out)}
    requests = tuple(
        BenchRequest(
            i,
            t.at_ms / 1e3,
            t.token_request.output_length,
            messages=t.messages,
            session=t.token_request.session_id,
            after=index.get((t.session, t.turn - 1)),
            think_s=t.think_s,
        )
        for i, t in enumerate(turns_out)
    )
    trace = Trace(shape.name, "tokens", DEFAULT_BLOCK_SIZE, tuple(t.token_request for t in turns_out))
    return Workload(shape.name, requests, trace)


@dataclass(frozen=True)
class _Turn:
    at_ms: float
    session: int
    turn: int
    messages: tuple[dict[str, str], ...]
    token_request: TraceRequest
    think_s: float


def render_mooncake(path: str, vocab: Vocabulary, requests: int | None, block_tokens: int) -> Workload:
    """Completion prompts for a Mooncake trace, scaled to `block_tokens` tokens per hash id."""
    if not 1 <= block_tokens <= MOONCAKE_BLOCK_TOKENS:
        raise RenderError(f"block_tokens must be in [1, {MOONCAKE_BLOCK_TOKENS}], got {block_tokens}")
    try:
        trace = read_mooncake(Path(path))
    except ValueError as exc:
        raise RenderError(f"{TRACE_PREFIX}{path}: {exc}") from None
    if requests is not None:
        trace = Trace(trace.name, trace.kind, trace.block_size, trace.requests[:requests])
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    blocks: dict[int, str] = {}

    def block_words(hash_id: int) -> list[str]:
        rng = random.Random(f"mooncake-block-{hash_id}")
        return [vocab.words[rng.randrange(len(vocab.words))] for _ in range(block_tokens)]

    out = []
    start = trace.requests[0].arrival_ms
    for i, req in enumerate(trace.requests):
        tokens = max(1, math.ceil(req.input_length * scale))
        words: list[str] = []
        for hash_id in req.hash_ids:
            if hash_id not in blocks:
                blocks[hash_id] = "".join(block_words(hash_id))
            words.append(blocks[hash_id])
        text = "".join(words)
        # Each word is one leading space plus letters: cut at the `tokens`-th word.
        cut = _word_boundary(text, tokens)
        max_tokens = max(1, round(req.output_length * scale))
        out.append(BenchRequest(i, (req.arrival_ms - start) / 1e3, max_tokens, prompt=text[:cut]))
    return Workload(f"{TRACE_PREFIX}{trace.name}", tuple(out), trace)


def _word_boundary(text: str, words: int) -> int:
    """The offset just past the `words`-th space-led word of `text` (its whole length when shorter)."""
    position = -1
    for _ in range(words):
        position = text.find(" ", position + 1)
        if position < 0:
            return len(text)
    following = text.find(" ", position + 1)
    return len(text) if following < 0 else following


def token_ids(request: BenchRequest, tokenizer: Tokenizer, answer: str | None = None) -> list[int]:
    """The prompt's token ids as a kvroute gateway with this tokenizer computes them (`encode_chat` for
    messages, `encode` with special tokens for a prompt). With `answer`: the conversation with that answer
    after the prompt (chat: as the assistant message, no generation prompt; completion: appended)."""
    if request.messages is None:
        return tokenizer.encode((request.prompt or "") + (answer or ""), add_special_tokens=True)
    if answer is None:
        return tokenizer.encode_chat(list(request.messages))
    return tokenizer.encode_chat([*request.messages, {"role": "assistant", "content": answer}], False)


def dump_jsonl(workload: Workload, path: Path) -> None:
    """One request a line, `{"app", "prompt" | "messages", "timestamp" (ms), "session", "max_tokens"}`: the
    prefix doctor's input (`kvroute doctor FILE`); the app is the workload."""
    with path.open("w", encoding="utf-8") as f:
        for request in workload.requests:
            line: dict[str, Any] = {
                "app": workload.name,
                "timestamp": round(request.arrival_s * 1e3, 3),
                "session": request.session,
                "max_tokens": request.max_tokens,
            }
            if request.messages is not None:
                line["messages"] = list(request.messages)
            else:
                line["prompt"] = request.prompt
            f.write(json.dumps(line) + "\n")
