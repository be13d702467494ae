"""One request's life inside the engine: its tokens, how many of them have KV in the cache, and its status.

A sequence's tokens are its prompt followed by its output. `num_computed_tokens` of them have their K/V in
the sequence's blocks; the rest are computed by later steps. Prefill, a chunk of it, an extend over a cached
prefix, a decode and a recompute after preemption are all the same thing: compute tokens
`num_computed_tokens .. num_tokens - 1`, and sample the next token once the last one is computed.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field

import torch

from kvroute.hashing import BlockHash, BlockHasher
from kvroute.sampling import SamplingParams
from worker.sampler import TopLogprobs
from worker.structured_output import GrammarConstraint


@dataclass
class RequestTimings:
    """When a request reached each phase of its life in the engine (time.monotonic() seconds), and how many
    engine steps each phase took. The engine stamps them once per step; readers (metrics, spans) take them
    from the request's last RequestOutput.

    Phases as vLLM defines them: queued = arrival .. first scheduled, prefill = first scheduled .. first
    token, decode = first token .. last token. A prefill step computes prompt tokens (or recomputes them
    after a preemption); a decode step computes one generated token."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prefill_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: InitVar[Iterable[int]]  # the sequence's tokens start as its prompt: a copy of it, unless `keep_prompt`
    params: SamplingParams
    hasher: BlockHasher
    cache_salt: str = ""
    eos_token_ids: frozenset[int] = frozenset()  # the model's; they stop the sequence unless params.ignore_eos
    priority: int = 0  # vLLM's: lower is more urgent (read by the scheduler's priority policy only)
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per output token, with top_logprobs
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_emitted: int = 0  # output tokens already handed to the caller
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(time.monotonic()))
    # params.structured's grammar state, advanced by append_token only (worker/structured_output.py, rule 3);
    # None when unconstrained, or on an engine without logits (the sim runner ignores constraints).
    constraint: GrammarConstraint | None = None
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    keep_prompt: InitVar[bool] = False  # `prompt` is a list its caller gives up: it becomes `token_ids`, uncopied

    def __post_init__(self, prompt: Iterable[int], keep_prompt: bool) -> None:
        self.token_ids = prompt if keep_prompt and isinstance(prompt, list) else list(prompt)
        self.num_prompt_tokens = len(self.token_ids)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own RNG on `device` when params.seed is set (created, seeded, on first use), else None.
        A sequence samples on one device all its life."""
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device).manual_seed(self.params.seed)
        return self._generator

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of the tokens so far (prompt and output), computed incrementally."""
        self.hasher.update(self.token_ids)
        return self.hasher.hashes

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if self.constraint is not None:
            self.constraint.accept(token_id)

    @functools.cached_property
    def stopping_token_ids(self) -> frozenset[int]:
        """The tokens that end this sequence when sampled: its stop_token_ids, and the model's EOS unless
        params.ignore_eos (fixed for its life, so built once, not at every token)."""
        stops = frozenset(self.params.stop_token_ids)
        return stops if self.params.ignore_eos else stops | self.eos_token_ids

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """The tokens the sampler must not pick at the next position: every stopping token while the output is
        shorter than params.min_tokens (vLLM's min_tokens), else none. A grammar decides alone where its output
        may end."""
        if self.num_output_tokens >= self.params.min_tokens or self.constraint is not None:
            return ()
        return tuple(sorted(self.stopping_token_ids))

    def check_stop(self) -> str | None:
        """The finish reason after the last appended token, or None to continue."""
        if self.token_ids[-1] in self.stopping_token_ids:
            return "stop"
        if self.constraint is not None and self.constraint.done:
            return "abort" if self.constraint.rejected else "stop"
        if self.num_output_tokens >= self.params.max_tokens:
            return "length"
        return None
