"""One simulated replica: the real engine (LLMEngine, Scheduler, KVCacheManager, BlockPool) with the sim runner
on a virtual clock of its own.

The replica's clock stands at the end of the step it computed last (`busy_until`). The fleet simulator calls
`step()` when that time comes round: the step's results are then delivered (tokens, finishes, KV events, and
its books at its end: `reported`, what a gateway reads, never the books of the step computed since), and the
next step is computed at once, its results held until its own end. A request added in between joins the
next step, as a request that reaches a live engine during a step does.

Where the engine says the next steps are plain decodes (every running request decodes a token and nothing else
changes: LLMEngine.decode_steps_ahead), the replica takes them as one run, when the run ends or when a request
arrives during it (then up to the step in progress): the engine's `step(n)` gives the same tokens, books and
clock as n single steps, and nothing a gateway reads (load, KV events) changes during such a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.hashing import BlockHash
from kvroute.kv_events import KVEvent
from kvroute.sampling import SamplingParams
from worker.clock import VirtualClock
from worker.config import EngineConfig
from worker.engine import LLMEngine, RequestOutput
from worker.sequence import Sequence as EngineSequence
from worker.sim_runner import SimCostModel, SimRunner

# Tokens a scripted answer continues with once the trace's known answer is spent: one per request, above any
# id a tokenizer or a synthetic trace uses, so such a tail never matches another request's blocks.
_FILLER_BASE = 2**31


@dataclass(frozen=True)
class Load:
    """A replica's books at the end of a step, as a live worker reports them (GetStats): running and waiting
    requests, and the share of KV blocks in use."""

    running: int
    waiting: int
    kv_usage: float


@dataclass
class StepDone:
    """What one step delivered at its end (`at`): the engine's outputs, the KV events it produced, and the
    books as they stood then (`load`)."""

    at: float
    outputs: list[RequestOutput]
    load: Load
    events: list[KVEvent] = field(default_factory=list)


class SimReplica:
    """`capacity_blocks` KV blocks of `block_size` tokens; `cost` paces the steps; block hashes use `model_id`.
    `max_num_batched_tokens`, `max_num_seqs` and `watermark` are the engine's (EngineConfig's defaults).
    `step_overhead_s`: time every step takes beyond the cost model (a live worker's own work per step, measured;
    0 by default)."""

    def __init__(
        self,
        name: str,
        capacity_blocks: int,
        block_size: int,
        cost: SimCostModel,
        model_id: str,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        watermark: float = EngineConfig.watermark,
        max_model_len: int = 1 << 30,
        step_overhead_s: float = 0.0,
        host_kv_blocks: int = 0,
    ) -> None:
        self.name = name
        self.clock = VirtualClock()
        config = EngineConfig(
            model="sim",
            block_size=block_size,
            num_kv_blocks=capacity_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            watermark=watermark,
            max_model_len=max_model_len,
            host_kv_blocks=host_kv_blocks,
        )
        self.runner = SimRunner(config, cost, clock=self.clock, outputs=self._next_token, outputs_run=self._next_tokens)
        # Its KV events feed the gateways' indexes, which read their hashes only.
        self.engine = LLMEngine(
            config, clock=self.clock, sim_runner=self.runner, model_id=model_id, event_token_ids=False
        )
        self._answers: dict[str, tuple[Sequence[int], int]] = {}  # request id -> (known answer, filler token)
        self._pending: StepDone | None = None  # the step computed last, delivered at its end
        self._overhead_s = step_overhead_s
        self._decode_s = cost.decode_ms_per_step * 1e-3 + step_overhead_s  # one plain decode step
        self._run = 0  # plain decode steps from `_run_start` not yet taken (0: none in progress)
        self._run_start = 0.0
        self.reported = Load(0, 0, 0.0)  # the books at the end of the step delivered last
        self.busy_s = 0.0  # time spent in steps
        self.requests = 0

    @property
    def busy_until(self) -> float:
        """When the step (or run of plain decode steps) in progress ends."""
        if self._run:
            return self._run_start + self._run * self._decode_s
        return self.clock.now()

    @property
    def steps(self) -> int:
        """Engine steps that computed tokens, as a live worker counts them."""
        return self.engine.num_steps

    @property
    def idle(self) -> bool:
        """Nothing computed and nothing to compute: the next request starts a step at its arrival."""
        return self._pending is None and not self._run and not self.engine.has_unfinished_requests()

    def add(
        self,
        request_id: str,
        filler: int,
        prompt: list[int],
        max_tokens: int,
        answer: Sequence[int] = (),
        cache_salt: str = "",
        now: float = 0.0,
        priority: int = 0,
        prompt_hashes: Sequence[BlockHash] | None = None,
    ) -> bool:
        """Queue a request arriving at `now` (`priority`: vLLM's, read under the priority policy); it samples
        `answer` first, then the token `_FILLER_BASE + filler`. `prompt` is the caller's no more: the engine keeps
        it as the request's tokens. `prompt_hashes`: the prompt's block hashes under this replica's model id and
        block size and `cache_salt` (a gateway's in this process, by the same code), which its engine takes
        instead of hashing the prompt again (LLMEngine.add_request).
        An idle replica's clock moves to `now`; a busy one takes the request into its next step. True when
        `busy_until` moved (the replica was idle, or a run of plain decodes was cut at the step in progress)."""
        moved = self.idle
        if moved:
            self.clock.advance_to(now)
        elif self._run:
            # The steps of the run up to the one in progress at `now` happened; the request joins the next.
            taken = min(int((now - self._run_start) / self._decode_s) + 1, self._run)
            self._run = 0
            outputs = self._take(taken)
            self._pending = StepDone(self.clock.now(), outputs, self._load())
            moved = True
        self._answers[request_id] = (answer, _FILLER_BASE + filler)
        params = SamplingParams(max_tokens=max(max_tokens, 1), temperature=0.0, ignore_eos=True)
        self.engine.add_request(
            request_id,
            prompt,
            params,
            cache_salt=cache_salt,
            priority=priority,
            prompt_hashes=prompt_hashes,
            keep_prompt=True,
        )
        self.requests += 1
        return moved

    def step(self) -> StepDone | None:
        """At `busy_until`: deliver what ended then (None if nothing did) and start what comes next: one step,
        or a run of plain decode steps (LLMEngine.decode_steps_ahead), taken when it ends or is cut."""
        done, self._pending = self._pending, None
        if self._run:
            run, self._run = self._run, 0
            outputs = self._take(run)
            done = StepDone(self.clock.now(), outputs, self._load())
        if done is not None:
            self.reported = done.load
        if not self.engine.has_unfinished_requests():
            return done
        ahead = self.engine.decode_steps_ahead() if self._decode_s > 0 else 0
        if ahead >= 2:
            self._run, self._run_start = ahead, self.clock.now()
            return done
        start = self.clock.now()
        outputs = self.engine.step()
        if self._overhead_s:
            self.clock.sleep(self._overhead_s)
        if not outputs and not self.engine.scheduler.running and self.engine.has_unfinished_requests():
            raise RuntimeError(f"{self.name}: a step with nothing to schedule (a request larger than the cache?)")
        self.busy_s += self.clock.now() - start
        self._pending = StepDone(self.clock.now(), outputs, self._load(), self.engine.drain_kv_events())
        self._forget_finished(outputs)
        return done

    def _take(self, num_steps: int) -> list[RequestOutput]:
        start = self.clock.now()
        outputs = self.engine.step(num_steps)
        if self._overhead_s:
            self.clock.sleep(num_steps * self._overhead_s)
        self.busy_s += self.clock.now() - start
        self._forget_finished(outputs)
        return outputs

    def _load(self) -> Load:
        scheduler = self.engine.scheduler
        return Load(len(scheduler.running), len(scheduler.waiting), self.engine.kv_manager.pool.usage)

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                del self._answers[out.request_id]

    def _next_token(self, seq: EngineSequence) -> int:
        answer, filler = self._answers[seq.request_id]
        position = seq.num_output_tokens
        return answer[position] if position < len(answer) else filler

    def _next_tokens(self, seq: EngineSequence, num_steps: int) -> list[int]:
        answer, filler = self._answers[seq.request_id]
        position = seq.num_output_tokens
        tokens = list(answer[position : position + num_steps])
        return tokens + [filler] * (num_steps - len(tokens))
