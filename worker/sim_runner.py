"""`--model sim`: a runner without weights, for fleets of workers on one machine (gateway and load tests).

It drives the real scheduler and block manager and spends time by one cost model (`SimCostModel`):
`prefill_us_per_token` for every token computed by a prefill chunk (cached prefix tokens cost nothing, as
they are never scheduled) plus `decode_ms_per_step` for a step that decodes, plus `host_copy_us_per_block` for
each block copied to or from a host KV tier (`--host-kv-blocks`; worker/host_kv_tier.py). The time is spent on the
engine's clock (worker.clock): wall time in a live sim worker, virtual time in the fleet simulator (sim/),
which runs this very runner and cost model.

Its tokens are deterministic: a hash of the sequence's last token, its position and the engine's seed picks
one of the tokenizer's single-token words (worker.sim_words), so equal contexts give equal outputs on every
worker of a fleet, and the detokenized answer re-tokenizes to the same ids. A chat client that sends the
answer back in its next turn therefore sends the tokens whose KV the worker cached as it decoded them, as
with a real model whose output round-trips. The simulator scripts them instead (`outputs`): a trace's known
answers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sized
from dataclasses import dataclass

from kvroute.tokenizer import Tokenizer
from worker.clock import WALL_CLOCK, Clock
from worker.config import EngineConfig
from worker.host_kv_tier import host_tier_blocks
from worker.sampler import SamplerOutput
from worker.scheduler import SchedulerOutput
from worker.sequence import Sequence
from worker.sim_words import single_token_words

SIM_MAX_MODEL_LEN = 32768
# A notional Llama-3-8B's KV block (bf16): 2 * 32 layers * 16 tokens * 8 kv heads * 128 dims * 2 bytes = 2 MiB,
# scaled by the block size, so `kv_cache_memory_gb` means the same for sim and real workers.
SIM_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


@dataclass(frozen=True)
class SimCostModel:
    """What a step costs: every token a prefill chunk computes, plus one decode step if any row decodes
    (a row of one token that samples a sequence with output already: a decode; every other row: prefill)."""

    prefill_us_per_token: float = 32.0
    decode_ms_per_step: float = 20.0
    host_copy_us_per_block: float = 67.0  # a block's copy to or from the host tier (EngineConfig's default)

    def step_seconds(self, batch: SchedulerOutput) -> float:
        decodes = False
        prefill_tokens = 0
        for s in batch.seqs:
            if s.num_new_tokens == 1 and s.samples:
                decodes = True
            else:
                prefill_tokens += s.num_new_tokens
        return prefill_tokens * self.prefill_us_per_token * 1e-6 + (self.decode_ms_per_step * 1e-3 if decodes else 0.0)


class SimRunner:
    """`tokenizer` is the engine's (sim workers use SmolLM2's); without one and without `outputs` the sim
    model's own is loaded. `clock` spends each step's cost (wall time unless given). `outputs(seq)`, when
    given, is the token a sequence samples next (the simulator replays a trace's known answers with it), and
    `outputs_run(seq, n)` the next n at once (LLMEngine.step(n)); they must agree."""

    def __init__(
        self,
        config: EngineConfig,
        cost: SimCostModel | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Clock = WALL_CLOCK,
        outputs: Callable[[Sequence], int] | None = None,
        outputs_run: Callable[[Sequence, int], list[int]] | None = None,
    ) -> None:
        self.cost = cost or SimCostModel(
            config.sim_prefill_us_per_token, config.sim_decode_ms_per_step, config.sim_host_copy_us_per_block
        )
        self.seed = config.seed
        self.block_size = config.block_size
        self.clock = clock
        self.outputs = outputs
        self.outputs_run = outputs_run
        self.output_ids: tuple[int, ...] = ()
        if outputs is None:
            if tokenizer is None:
                from kvroute.model_source import resolve_model
                from worker.model import load_tokenizer

                tokenizer = load_tokenizer(resolve_model(config.model))
            self.output_ids = _word_ids(tokenizer)
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            memory = int(config.kv_cache_memory_gb * 2**30)
            self.num_kv_blocks = max(1, memory // (SIM_KV_BYTES_PER_TOKEN * config.block_size))
        # A host tier of notional blocks: no memory is taken, only the copies' time (spent with the next step).
        self.num_host_kv_blocks = host_tier_blocks(config, SIM_KV_BYTES_PER_TOKEN * config.block_size)
        self.pending_copy_seconds = 0.0

    def warm_up(self) -> None:
        """Nothing to build: no weights, no kernels."""

    def copy_to_host(self, device_blocks: Sized, host_slots: Sized) -> None:
        """KVBlockCopier: only the time, spent with the next step."""
        self._count_copies(len(device_blocks))

    def copy_from_host(self, host_slots: Sized, device_blocks: Sized) -> None:
        self._count_copies(len(device_blocks))

    def copy_pays(self) -> bool:
        """KVBlockCopier: by the cost model's parameters, a block's copy against its tokens' prefill."""
        return self.cost.host_copy_us_per_block < self.cost.prefill_us_per_token * self.block_size

    def _count_copies(self, num_blocks: int) -> None:
        self.pending_copy_seconds += num_blocks * self.cost.host_copy_us_per_block * 1e-6

    def _spend(self, seconds: float) -> None:
        """`seconds` of computing, and the copies made since the last spend, on the clock."""
        seconds += self.pending_copy_seconds
        self.pending_copy_seconds = 0.0
        if seconds > 0:
            self.clock.sleep(seconds)

    def run(self, batch: SchedulerOutput) -> SamplerOutput:
        self._spend(self.cost.step_seconds(batch))
        token_ids = [self.sample(s.seq) for s in batch.sampling]
        return SamplerOutput(token_ids, [0.0] * len(token_ids))

    def spend_decode_steps(self, num_steps: int) -> None:
        """The cost of `num_steps` steps that only decode (LLMEngine.step(n)), spent at once."""
        self._spend(num_steps * self.cost.decode_ms_per_step * 1e-3)

    def sample(self, seq: Sequence) -> int:
        """The token `seq` samples next: `outputs(seq)` when given, else `next_token`."""
        if self.outputs is not None:
            return self.outputs(seq)
        return self.next_token(seq.token_ids[-1], seq.num_tokens)

    def sample_run(self, seq: Sequence, num_steps: int) -> list[int]:
        """The tokens `seq` samples in its next `num_steps` decode steps, one per step: `outputs_run(seq, n)`
        when the script has it, else `sample` step by step."""
        if self.outputs_run is not None:
            return self.outputs_run(seq, num_steps)
        if self.outputs is not None:
            raise ValueError("a scripted sim runner needs outputs_run for several decode steps at once")
        tokens, last, position = [], seq.token_ids[-1], seq.num_tokens
        for _ in range(num_steps):
            last = self.next_token(last, position)
            tokens.append(last)
            position += 1
        return tokens

    def next_token(self, last_token: int, position: int) -> int:
        """A fixed pseudo-random function of the context's last token and length and the seed (Knuth's
        multiplicative hash), mapped onto the single-token words."""
        mixed = (last_token * 2654435761 + position * 40503 + self.seed * 2246822519 + 12345) % 2**32
        return self.output_ids[(mixed * 2654435761 >> 7) % len(self.output_ids)]


@functools.lru_cache(maxsize=4)
def _word_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The token ids of the tokenizer's single-token words (engines in one process share the tokenizer)."""
    return tuple(word.token_id for word in single_token_words(tokenizer))
