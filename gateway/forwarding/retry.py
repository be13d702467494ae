"""Retries before the first token, a circuit breaker per worker, and the deadlines of a stream on its worker
(SGLang's router keeps retries and breakers as their own layer, with stated defaults; so do we).

Retries: a worker that fails before it streamed a token (unreachable, draining, engine fault, queue full) is
retried on another candidate: the failed workers are excluded from the next `pick`. At most `retries` more
attempts (`--retries`, default 2, so three workers at most), each after a backoff drawn uniformly from
[0, min(cap, base x 2^attempt)] ("full jitter": many gateways retrying at once do not stampede in step).
Defaults: base 10 ms, cap 250 ms. After the first token nothing is retried: the client has seen output.

Circuit breaker, per worker:
    closed ──K consecutive failures──► open ──cool-down──► half-open ──probe succeeds──► closed
                                         ▲                     │
                                         └──probe fails────────┘
An open worker is excluded from routing. After the cool-down, one request (the probe) may go to it; others
still avoid it until the probe ends. Defaults: K = 5 failures, cool-down 5 s. A success (a first token)
resets the failure count. The fleet state's own health checks are the other half: a worker that stops
answering leaves the candidates there; the breaker catches a worker that answers health but fails requests.

Stream deadlines (`StreamDeadlines`): a worker request that has waited `first_token_s` (default 10 s) for its
first message, or `inter_token_s` (default 5 s) for the next one, is overdue. An overdue worker that still
answers its fleet state's checks (FleetState.answering) is busy, not hung (a long prefill, a full batch):
the stream waits on, up to `answering_cap` times the deadline (100 s and 50 s by default). One that has
stopped answering is hung: the stream ends with an error naming the worker (before its first token the
request is retried on another worker, as for any failure). Time spent waiting for the client (a slow
reader) never counts: only time spent waiting on the worker.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2
    backoff_base_s: float = 0.010
    backoff_cap_s: float = 0.250

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"--retries must be >= 0, got {self.retries}")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (1 for the first retry)."""
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (attempt - 1))
        return (rng or random).uniform(0.0, ceiling)


@dataclass(frozen=True)
class StreamDeadlines:
    first_token_s: float = 10.0  # --first-token-timeout
    inter_token_s: float = 5.0  # --inter-token-timeout
    answering_cap: float = 10.0  # a worker that still answers gets this many deadlines at most

    def __post_init__(self) -> None:
        for flag, seconds in (
            ("--first-token-timeout", self.first_token_s),
            ("--inter-token-timeout", self.inter_token_s),
        ):
            if not seconds > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
        if not self.answering_cap >= 1:
            raise ValueError(f"answering_cap must be >= 1, got {self.answering_cap}")

    def overdue(self, waited_s: float, started: bool, answering: Callable[[], bool]) -> str | None:
        """Why a stream that has waited `waited_s` seconds on its worker must end now (a phrase that follows
        "worker <id>"), or None to wait on. `started`: the stream has had its first message; `answering` is
        asked only once the deadline has passed."""
        deadline = self.inter_token_s if started else self.first_token_s
        if waited_s < deadline:
            return None
        what = "next token" if started else "first token"
        cap = deadline * self.answering_cap
        if waited_s >= cap:
            return f"sent no {what} for {waited_s:.1f} s, the cap for a worker that still answers ({cap:g} s)"
        if answering():
            return None
        return f"sent no {what} for {waited_s:.1f} s and stopped answering the fleet state's checks (hung)"


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False


class CircuitBreakers:
    """One breaker per worker id, created on its first failure. Single-threaded (the gateway's event loop).

    Caller contract: for each request sent to a worker, `on_dispatch` first, then exactly one of
    `on_success` (its first token came), `on_failure` (it failed before one), `on_abandoned` (neither: the
    client left first)."""

    def __init__(
        self, failure_threshold: int = 5, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._breakers: dict[str, _Breaker] = {}
        self._blocked: frozenset[str] = frozenset()  # cache of `blocked()`, rebuilt when a breaker changes

    def blocked(self) -> frozenset[str]:
        """Workers that must not get a request now: open ones still cooling down, and half-open ones whose
        probe is in flight. A worker whose cool-down has passed is not blocked: its next request probes."""
        if self._blocked:
            now = self.clock()
            cooled = (b for b in self._breakers.values() if b.state is BreakerState.OPEN and not b.probing)
            if any(now - b.opened_at >= self.cooldown_s for b in cooled):
                self._rebuild()
        return self._blocked

    def state(self, worker_id: str) -> BreakerState:
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            return BreakerState.CLOSED
        if breaker.state is BreakerState.OPEN and self.clock() - breaker.opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return breaker.state

    def states(self) -> dict[str, BreakerState]:
        return {worker_id: self.state(worker_id) for worker_id in self._breakers}

    def on_dispatch(self, worker_id: str) -> None:
        """A request goes to the worker; past its cool-down, that request is the probe."""
        breaker = self._breakers.get(worker_id)
        if breaker is not None and self.state(worker_id) is BreakerState.HALF_OPEN and not breaker.probing:
            breaker.state, breaker.probing = BreakerState.HALF_OPEN, True
            self._rebuild()

    def on_success(self, worker_id: str) -> None:
        breaker = self._breakers.get(worker_id)
        if breaker is None:
            return
        if breaker.state is not BreakerState.CLOSED or breaker.failures:
            del self._breakers[worker_id]
            self._rebuild()

    def on_abandoned(self, worker_id: str) -> None:
        """The request ended before the worker proved anything; a probe it carried may be sent again."""
        breaker = self._breakers.get(worker_id)
        if breaker is not None and breaker.probing:
            breaker.state, breaker.probing = BreakerState.OPEN, False
            self._rebuild()

    def on_failure(self, worker_id: str) -> None:
        breaker = self._breakers.setdefault(worker_id, _Breaker())
        breaker.failures += 1
        if breaker.state is BreakerState.HALF_OPEN or breaker.failures >= self.failure_threshold:
            breaker.state, breaker.opened_at, breaker.probing = BreakerState.OPEN, self.clock(), False
        self._rebuild()

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet (or restarted): its history no longer applies."""
        if self._breakers.pop(worker_id, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        now = self.clock()
        self._blocked = frozenset(
            w
            for w, b in self._breakers.items()
            if (b.state is BreakerState.OPEN and now - b.opened_at < self.cooldown_s)
            or (b.state is BreakerState.HALF_OPEN and b.probing)
        )
