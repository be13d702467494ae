"""Synthetic token-id workloads for the seeds' scenarios (`kvroute replay synthetic:NAME`).

Every request carries its prompt's token ids, its output length (and, for chats, the answer's ids, so
the engine's cache of the answer serves the next turn), an app/session id and its tenant's cache salt.
Token ids are random draws, so distinct segments never share a block by chance. The worked numbers
(block size 16, checked in tests/test_workloads.py):

  support            3,300-token prompts, 2,900 shared, the request ID on line 2: ~1% hit rate
  support-id-at-end  the same with the ID moved to the end: ~88% (181 shared blocks = 2,896 tokens)
  multiturn          1,000-token system prompt, 100-token questions, 300-token answers, 6 turns per
                     chat: 12,600 prompt tokens, ~1,640 prefilled with a perfect cache (1,100 + 5 x 108)
  multiturn-trim     10 turns; from turn 7 on the oldest turn (question + answer) is dropped: each such
                     turn prefills ~2,100 tokens (3,100 - 992, only the system prompt survives)
  rag-shuffled       800 + 5 x 300 + 50 tokens, each request of a topic opens with another passage:
                     a warm request reuses the system prompt only, 800 / 2,350 = 34%
  rag-sorted         passages in a canonical order: a warm request reuses 2,288 / 2,350 = 97%
  agents             a 2,000-token tool-schema prefix, per-agent instructions and a growing history
  tenants            one system prompt text, a distinct cache salt per tenant: no cross-tenant hits
  repeat             distinct 512-token prompts, each sent twice (the repeats shuffled): behind
                     round-robin over 4 replicas a repeat finds its holder about 1 time in 4
  lru-churn          5 prefixes of 4 blocks each, in order, twice: through 16 blocks (4 slots) none of
                     the 10 hits, through 20 blocks (5 slots) the second pass hits, 5 of 10

Four shapes whose shared prefix is longer than any fixed routing key, or not at the front (each function's
docstring gives its numbers; sized for 8 replicas under load, 2,000 requests by default):

  platform           a 1,500-token platform prompt on everything, per-tenant tool schemas (Zipf tenants),
                     growing agent sessions and one-off requests
  many-apps          24 apps whose shared prefixes run from 200 to 6,000 tokens, mixed in one stream
  hot-prompt         one 2,000-token prompt on every request, at high load
  rag-middle         a system prompt, then a topic's documents (the shared middle), then the question
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.hashing import DEFAULT_BLOCK_SIZE
from sim.traces import Trace, TraceRequest

VOCAB_SIZE = 32_000
DEFAULT_REQUESTS = 200


class WorkloadError(ValueError):
    """An unknown workload name or a bad size."""


@dataclass
class _Gen:
    """Random token segments and arrival times for one workload."""

    rng: random.Random
    mean_gap_ms: float = 500.0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB_SIZE) for _ in range(n)]

    def next_turn(self, at: float, think_ms: float, answer_ms: float = 10_000.0) -> float:
        """The user's next turn: after the answer (10 s covers a 300-token one under the default cost
        model), plus a random think time, so that chats do not advance in lockstep (which would flatter
        round-robin)."""
        return round(at + answer_ms + self.rng.expovariate(1 / think_ms), 3)

    def gaps(self, n: int) -> list[float]:
        """Poisson arrival times for n requests."""
        t, out = 0.0, []
        for _ in range(n):
            out.append(round(t, 3))
            t += self.rng.expovariate(1 / self.mean_gap_ms)
        return out


def _request(
    at: float, prompt: list[int], output: int, session: str, answer: list[int] | None = None, salt: str = ""
) -> TraceRequest:
    return TraceRequest(
        at,
        len(prompt),
        output,
        token_ids=tuple(prompt),
        output_token_ids=tuple(answer or ()),
        session_id=session,
        cache_salt=salt,
    )


def support(n: int, gen: _Gen, block_size: int, id_at_end: bool = False) -> list[TraceRequest]:
    line1, rest = gen.tokens(40), gen.tokens(2860)  # the 2,900 shared tokens
    out = []
    for at in gen.gaps(n):
        request_id, question = gen.tokens(8), gen.tokens(392)
        if id_at_end:
            prompt = line1 + rest + question + request_id
        else:
            prompt = line1 + request_id + rest + question
        out.append(_request(at, prompt, 200, "support"))
    return out


def multiturn(
    n: int, gen: _Gen, block_size: int, turns: int = 6, keep_turns: int | None = None, think_ms: float = 20_000.0
) -> list[TraceRequest]:
    """Chats sharing one 1,000-token system prompt; with `keep_turns`, only that many past turns stay."""
    system = gen.tokens(1000)
    chats = -(-n // turns)
    out: list[TraceRequest] = []
    for chat, at in enumerate(gen.gaps(chats)):
        history: list[list[int]] = []
        for _ in range(turns):
            if len(out) == n:
                break
            question, answer = gen.tokens(100), gen.tokens(300)
            kept = history if keep_turns is None else history[-keep_turns:]
            prompt = system + [t for past in kept for t in past] + question
            out.append(_request(at, prompt, len(answer), f"chat-{chat}", answer))
            history.append(question + answer)
            at = gen.next_turn(at, think_ms)
    return sorted(out, key=lambda r: r.arrival_ms)


def rag(n: int, gen: _Gen, block_size: int, shuffled: bool, per_topic: int = 5) -> list[TraceRequest]:
    system = gen.tokens(800)
    out = []
    topics: list[list[list[int]]] = []
    for i, at in enumerate(gen.gaps(n)):
        if i % per_topic == 0:
            topics.append([gen.tokens(300) for _ in range(5)])
        passages = topics[-1]
        if shuffled:
            # Each request of a topic opens with another passage, the rest in a random order.
            first = i % per_topic % len(passages)
            rest = [p for j, p in enumerate(passages) if j != first]
            gen.rng.shuffle(rest)
            order = [passages[first], *rest]
        else:
            order = passages
        prompt = system + [t for p in order for t in p] + gen.tokens(50)
        out.append(_request(at, prompt, 100, f"topic-{len(topics) - 1}"))
    return out


def agents(n: int, gen: _Gen, block_size: int, num_agents: int = 8, think_ms: float = 5_000.0) -> list[TraceRequest]:
    """Agents sharing a 2,000-token tool-schema prefix; each step appends a tool result and the answer."""
    schema = gen.tokens(2000)
    steps = -(-n // num_agents)
    out: list[TraceRequest] = []
    for agent, at in enumerate(gen.gaps(num_agents)):
        history = schema + gen.tokens(200)  # the agent's own instructions
        for _ in range(steps):
            if len(out) == n:
                break
            history = history + gen.tokens(150)  # the last tool call's result
            answer = gen.tokens(100)
            out.append(_request(at, history, len(answer), f"agent-{agent}", answer))
            history = history + answer
            at = gen.next_turn(at, think_ms)
    return sorted(out, key=lambda r: r.arrival_ms)


def tenants(n: int, gen: _Gen, block_size: int, num_tenants: int = 4) -> list[TraceRequest]:
    system = gen.tokens(1000)  # the same text for every tenant; only the salt differs
    return [
        _request(at, system + gen.tokens(100), 100, f"tenant-{i % num_tenants}", salt=f"tenant-{i % num_tenants}")
        for i, at in enumerate(gen.gaps(n))
    ]


def _zipf_weights(k: int, s: float = 1.1) -> list[float]:
    return [1 / (i + 1) ** s for i in range(k)]


def platform(n: int, gen: _Gen, block_size: int, num_tenants: int = 16) -> list[TraceRequest]:
    """A 1,500-token platform prompt, then one of 16 tenants' tool schemas (2,000-3,000 tokens; tenants
    drawn Zipf(1.1): the first carries about 30% of the traffic), then either an agent session (75% of
    requests: 200 tokens of instructions, and per step a 150-token tool result and a 100-token answer,
    3 to 8 steps a few seconds apart) or a one-off question (50-400 tokens). About 8 requests/s.
    Every request shares the first 1,500 tokens, and most share 3,500-4,500 with their tenant."""
    system = gen.tokens(1500)
    schemas = [system + gen.tokens(gen.rng.randint(2000, 3000)) for _ in range(num_tenants)]
    weights = _zipf_weights(num_tenants)
    out: list[TraceRequest] = []
    at, session = 0.0, 0
    while len(out) < 0.75 * n:  # agent sessions: 5.5 steps on average, 6 requests/s of steps
        at += gen.rng.expovariate(6.0 / 5.5 / 1000)
        tenant = gen.rng.choices(range(num_tenants), weights)[0]
        history, step_at = schemas[tenant] + gen.tokens(200), at
        for _ in range(gen.rng.randint(3, 8)):
            history = history + gen.tokens(150)
            answer = gen.tokens(100)
            out.append(_request(round(step_at, 3), history, len(answer), f"t{tenant}-agent-{session}", answer))
            history = history + answer
            step_at = gen.next_turn(step_at, 3000.0, answer_ms=2_000.0)  # 100 tokens: about 2 s
        session += 1
    at = 0.0
    while len(out) < 1.25 * n:  # one-offs: 2 requests/s
        at += gen.rng.expovariate(2.0 / 1000)
        tenant = gen.rng.choices(range(num_tenants), weights)[0]
        prompt = schemas[tenant] + gen.tokens(gen.rng.randint(50, 400))
        out.append(_request(round(at, 3), prompt, 100, f"t{tenant}-oneoff"))
    return sorted(out, key=lambda r: r.arrival_ms)[:n]


def many_apps(n: int, gen: _Gen, block_size: int, num_apps: int = 24) -> list[TraceRequest]:
    """24 apps, each with its own shared prefix of 200 to 6,000 tokens (log-uniform), drawn Zipf(1.1);
    each request is its app's prefix and a unique 50-500-token part, answered in 50-300 tokens. About 10
    requests/s. The shared part is 200 tokens for some apps and 30 times that for others, so no one key
    depth fits them all."""
    prefixes = [gen.tokens(round(200 * 30 ** gen.rng.random())) for _ in range(num_apps)]
    weights = _zipf_weights(num_apps)
    gen.mean_gap_ms = 100.0
    out = []
    for at in gen.gaps(n):
        app = gen.rng.choices(range(num_apps), weights)[0]
        prompt = prefixes[app] + gen.tokens(gen.rng.randint(50, 500))
        out.append(_request(at, prompt, gen.rng.randint(50, 300), f"app-{app}"))
    return out


def hot_prompt(n: int, gen: _Gen, block_size: int) -> list[TraceRequest]:
    """One 2,000-token prompt on every request, then a unique 100-token question; 150-token answers, 25
    requests/s (about 9 requests in flight per replica of 8). Every replica should hold the prompt and
    take an even share: pinning it to one replica, or to the few a ring walk reaches, queues them."""
    prompt = gen.tokens(2000)
    gen.mean_gap_ms = 40.0
    return [_request(at, prompt + gen.tokens(100), 150, "hot") for at in gen.gaps(n)]


def rag_middle(n: int, gen: _Gen, block_size: int, num_topics: int = 40) -> list[TraceRequest]:
    """A 600-token system prompt, then 3 of its topic's 6 documents (400 tokens each, in the topic's
    canonical order), then a unique 60-token question; topics drawn Zipf(1.1), 100-token answers, about
    8 requests/s. The shared part is in the middle: two requests of a topic share the system prompt and
    the documents up to the first that differs (0 to 3 documents), never the question."""
    system = gen.tokens(600)
    topics = [[gen.tokens(400) for _ in range(6)] for _ in range(num_topics)]
    weights = _zipf_weights(num_topics)
    gen.mean_gap_ms = 125.0
    out = []
    for at in gen.gaps(n):
        topic = gen.rng.choices(range(num_topics), weights)[0]
        chosen = sorted(gen.rng.sample(range(6), 3))
        prompt = system + [t for d in chosen for t in topics[topic][d]] + gen.tokens(60)
        out.append(_request(at, prompt, 100, f"topic-{topic}"))
    return out


def repeat(n: int, gen: _Gen, block_size: int) -> list[TraceRequest]:
    """n // 2 distinct prompts, then each once more in a shuffled order."""
    prompts = [gen.tokens(512) for _ in range(max(n // 2, 1))]
    order = list(range(len(prompts)))
    gen.rng.shuffle(order)
    sequence = list(range(len(prompts))) + order
    return [
        _request(at, prompts[k], 50, f"prompt-{k}") for k, at in zip(sequence, gen.gaps(len(sequence)), strict=True)
    ]


def lru_churn(n: int, gen: _Gen, block_size: int, prefixes: int = 5, prefix_blocks: int = 4) -> list[TraceRequest]:
    """`prefixes` prompts of exactly `prefix_blocks` blocks, in order, over and over (n requests)."""
    prompts = [gen.tokens(prefix_blocks * block_size) for _ in range(prefixes)]
    # Far apart, so each request finishes (and frees its blocks) before the next arrives.
    return [_request(i * 10_000.0, prompts[i % prefixes], 1, f"prefix-{i % prefixes}") for i in range(n)]


Generator = Callable[[int, _Gen, int], list[TraceRequest]]
WORKLOADS: dict[str, tuple[Generator, int]] = {
    # name -> (generator, default request count)
    "support": (support, DEFAULT_REQUESTS),
    "support-id-at-end": (lambda n, g, b: support(n, g, b, id_at_end=True), DEFAULT_REQUESTS),
    "multiturn": (multiturn, 60),
    "multiturn-trim": (lambda n, g, b: multiturn(n, g, b, turns=10, keep_turns=5), 100),
    "rag-shuffled": (lambda n, g, b: rag(n, g, b, shuffled=True), DEFAULT_REQUESTS),
    "rag-sorted": (lambda n, g, b: rag(n, g, b, shuffled=False), DEFAULT_REQUESTS),
    "agents": (agents, 96),
    "tenants": (tenants, DEFAULT_REQUESTS),
    "repeat": (repeat, 400),
    "lru-churn": (lru_churn, 10),
    "platform": (platform, 2000),
    "many-apps": (many_apps, 2000),
    "hot-prompt": (hot_prompt, 2000),
    "rag-middle": (rag_middle, 2000),
}
WORKLOAD_NAMES = tuple(WORKLOADS)


def generate(name: str, requests: int | None = None, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """The token-id trace of workload `name` (see the module docstring), reproducible from `seed`."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if requests is not None and requests < 1:
        raise WorkloadError(f"requests must be >= 1, got {requests}")
    if block_size < 1:
        raise WorkloadError(f"block_size must be >= 1, got {block_size}")
    generator, default = WORKLOADS[name]
    reqs = generator(requests or default, _Gen(random.Random(seed)), block_size)
    return Trace(f"synthetic:{name}", "tokens", block_size, tuple(reqs))
