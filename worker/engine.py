"""LLMEngine: requests in, tokens out, one scheduler step at a time.

    add_request ─► Scheduler (waiting → running, blocks from KVCacheManager) ─► StepRunner (model + sampler)
                   ▲                                                           │
                   └──────────── update: append tokens, cache full blocks, free finished ◄┘

The engine is not thread-safe: one thread owns it (worker.async_engine runs its step loop). Its clock
(worker.clock) stamps request timings; the fleet simulator (sim/) gives it a virtual one and a sim runner that
spends each step's cost on it.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from kvroute.hashing import HASHED_TOKEN_IDS, BlockHash, BlockHasher, hash_block, root_hash
from kvroute.model_source import ModelSource, resolve_model
from kvroute.sampling import InvalidRequest, SamplingParams, validate_prompt
from kvroute.tokenizer import Tokenizer
from worker.block_pool import KVEvent
from worker.clock import WALL_CLOCK, Clock
from worker.config import EngineConfig
from worker.host_kv_tier import HostKVTier
from worker.kv_cache_manager import KVCacheManager
from worker.model.config import LlamaConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.weight_quantization import WeightQuantization
from worker.model_runner import StepRunner
from worker.sampler import TopLogprobs
from worker.scheduler import PriorityLoad, Scheduler
from worker.sequence import RequestTimings, Sequence
from worker.sim_runner import SIM_MAX_MODEL_LEN, SimRunner
from worker.structured_output import GrammarBackend

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]  # logprob of each chosen token (empty unless params.logprobs)
    # one per new token, most likely first (empty unless params.top_logprobs)
    new_top_logprobs: list[TopLogprobs]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at its first admission (< prompt_tokens)
    timings: RequestTimings | None = None  # on a request's finished output only (its phases, for metrics and spans)


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    num_running: int
    num_waiting: int
    prefix_queries: int  # tokens
    prefix_hits: int  # tokens
    num_preemptions: int
    num_preemptions_recomputed: int  # of those, resumed recomputing a full block (Scheduler)
    prompt_tokens_total: int
    generation_tokens_total: int
    # Under the priority policy, what each priority holds and has waiting (Scheduler.priority_loads); else empty.
    priority_loads: dict[int, PriorityLoad] = field(default_factory=dict)
    # The host tier (worker/host_kv_tier.py), zeros without one: its size and held blocks, the prefix hits
    # copied back from it (tokens, also in prefix_hits), the blocks copied each way.
    host_kv_blocks_total: int = 0
    host_kv_blocks_cached: int = 0
    host_prefix_hits: int = 0
    host_kv_blocks_saved: int = 0
    host_kv_blocks_restored: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by live requests, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0


class LLMEngine:
    """`clock` stamps request timings (wall time unless given). `sim_runner` (with `config.model` "sim"): run
    this runner instead of building one, with no tokenizer and any token id a prompt carries (the fleet
    simulator's replicas; their block hashes use `model_id` when given, else the sim model's id).
    `event_token_ids` False: `stored` KV events name no token ids (only vLLM's wire format needs them; the
    simulator's index reads the hashes)."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Clock = WALL_CLOCK,
        sim_runner: SimRunner | None = None,
        model_id: str | None = None,
        event_token_ids: bool = True,
    ) -> None:
        config.validate()
        self.config = config
        self.clock = clock
        source = resolve_model(config.model)
        if sim_runner is not None and source.kind != "sim":
            raise ValueError(f"a sim runner needs model 'sim', got {config.model!r}")
        self.model_id = model_id or source.model_id
        self.runner: StepRunner
        self._tokenizer: Tokenizer | None
        self.grammars: GrammarBackend | None  # compiles params.structured (None: constraints are ignored)
        self.dtype: torch.dtype
        self.dtype_reason: str  # why this dtype, e.g. "auto: float32, the CPU has no native bf16 (...)"
        self.attention_backend: str  # the attention path taken, and why, e.g. "cpu: torch path (...)"
        if source.kind == "sim":
            self._init_sim(source, sim_runner)
        else:
            self._init_model(source)
        log.info(
            "%s: dtype %s (%s); attention %s", self.model_id, self.dtype, self.dtype_reason, self.attention_backend
        )
        host_blocks = getattr(self.runner, "num_host_kv_blocks", 0)
        host_tier, copier = (HostKVTier(host_blocks), self.runner) if host_blocks else (None, None)
        self.kv_manager = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching, host_tier, copier
        )
        self.scheduler = Scheduler(config, self.kv_manager, event_token_ids)
        self._pending: list[RequestOutput] = []  # abort notices, handed out by the next step
        self._ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0  # steps that ran the model (each step of a run of plain decode steps counts)
        # Called on the engine's thread after every step that ran the model, with the tokens it computed.
        self.on_step: Callable[[int], None] | None = None

    def _init_model(self, source: ModelSource) -> None:
        from worker.model_runner import ModelRunner, resolve_dtype, uses_bf16_decode_weights, weight_quantization

        self.dtype, self.dtype_reason = resolve_dtype(self.config.dtype, source.kind, self.config.device)
        decode_copies = uses_bf16_decode_weights(self.config, self.dtype)
        quantization = weight_quantization(self.config)
        model, model_config = _load_model(source, self.dtype, self.config.device, decode_copies, quantization)
        self._tokenizer = tokenizer = _load_tokenizer(source)
        self.grammars = GrammarBackend(tokenizer)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(
            self.config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.runner = ModelRunner(self.config, model, model_config)
        self.attention_backend = self.runner.attention_path

    def _init_sim(self, source: ModelSource, runner: SimRunner | None) -> None:
        from worker.model_runner import resolve_dtype

        self.dtype, self.dtype_reason = resolve_dtype(self.config.dtype, source.kind, self.config.device)
        self.attention_backend = "none (sim: no model)"
        self.max_model_len = self.config.max_model_len or SIM_MAX_MODEL_LEN
        self.eos_token_ids = frozenset()  # sim outputs run to max_tokens, like the replay's output lengths
        self.grammars = None  # no logits to mask: a sim engine ignores `structured` (its words are no grammar's)
        if runner is not None:
            self._tokenizer = None
            self.vocab_size = HASHED_TOKEN_IDS  # token ids as uint32 (kvroute.hashing): any id a trace carries
            self.runner = runner
            return
        self._tokenizer = tokenizer = _load_tokenizer(source)
        self.vocab_size = tokenizer.vocab_size
        self.runner = SimRunner(self.config, tokenizer=tokenizer, clock=self.clock)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; ValueError for an engine given its sim runner (a fleet simulator's replica),
        which has none."""
        if self._tokenizer is None:
            raise ValueError("this engine runs a given sim runner on token ids only: it has no tokenizer")
        return self._tokenizer

    def warm_up(self) -> None:
        """Build kernels and JIT code now, before a worker reports SERVING, not in its first request's TTFT.
        Touches no request state and no cached block."""
        self.runner.warm_up()

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        priority: int = 0,
        grammar: Any = None,
        *,
        prompt_hashes: Seq[BlockHash] | None = None,
        keep_prompt: bool = False,
    ) -> None:
        """Queue a request (`priority`: vLLM's, lower is more urgent; the priority scheduling policy reads it;
        `grammar`: params.structured already compiled by `compile_structured`, else it is compiled here).
        Raises InvalidRequest naming the bad field; the engine is then unchanged.

        `prompt_hashes` is for a caller in this process that hashed this very prompt with kvroute.hashing (the
        fleet simulator's replicas): its full blocks' hashes, taken instead of hashing the prompt again. The
        gRPC service (worker/service.py, through worker/async_engine.py) never passes them: a worker computes
        its own hashes from the ids it was sent (DESIGN §1). They must be this engine's: its `model_id`, the
        request's `cache_salt` and its block size, one per full block; their count and the first block's hash
        are checked (ValueError otherwise). Hashing them refused any id outside uint32, so an engine whose
        vocabulary is all of uint32 (one given its sim runner) checks only the ids past them.

        `keep_prompt`: the request's token list, which grows with its output, is `prompt_token_ids` itself, not a
        copy: for a caller in this process that gives the list up (the fleet simulator's replicas)."""
        if request_id in self.scheduler.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        block_size = self.config.block_size
        known_ids = 0
        if prompt_hashes is not None:
            self._check_prompt_hashes(prompt_token_ids, cache_salt, prompt_hashes)
            if self.vocab_size >= HASHED_TOKEN_IDS:
                known_ids = len(prompt_hashes) * block_size
        self.validate_request(prompt_token_ids, params, known_ids)
        if grammar is None:
            grammar = self.compile_structured(params)
        hasher = BlockHasher(self.model_id, cache_salt, block_size, prompt_hashes or ())
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            hasher,
            cache_salt,
            self.eos_token_ids,
            priority,
            timings=RequestTimings(self.clock.now()),
            keep_prompt=keep_prompt,
        )
        if grammar is not None and self.grammars is not None:
            seq.constraint = self.grammars.constraint(grammar)
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_token_ids)

    def compile_structured(self, params: SamplingParams) -> Any:
        """params.structured (validated: `validate_request`) compiled for this engine's vocabulary (None when
        unconstrained, or on an engine that ignores constraints); InvalidRequest naming `structured` when it does
        not compile. Any thread may call it (the async engine does, before the request reaches the step loop)."""
        if params.structured is None or self.grammars is None:
            return None
        return self.grammars.compile(params.structured)

    def _check_prompt_hashes(self, prompt: list[int], cache_salt: str, hashes: Seq[BlockHash]) -> None:
        block_size = self.config.block_size
        if len(hashes) != len(prompt) // block_size or (
            hashes and hashes[0] != hash_block(root_hash(self.model_id, cache_salt), prompt[:block_size])
        ):
            raise ValueError(
                f"prompt_hashes are not this engine's for this prompt (model {self.model_id!r}, salt {cache_salt!r}, "
                f"block size {block_size}: {len(prompt) // block_size} blocks)"
            )

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams, known_ids: int = 0) -> None:
        """Raise InvalidRequest naming the bad field. Reads only the engine's fixed limits, so any thread may
        call it. `known_ids`: the prompt's leading ids already known to be in the vocabulary, not scanned."""
        params.validate()
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len, params.max_tokens, known_ids)
        needed = self.kv_manager.num_blocks_for(len(prompt_token_ids) + params.max_tokens)
        if needed > self.kv_manager.num_blocks:
            raise InvalidRequest(
                "max_tokens",
                f"prompt + max_tokens need {needed} KV blocks; this worker has {self.kv_manager.num_blocks}",
            )

    def abort_request(self, request_id: str) -> None:
        """Cancel a request wherever it is; its blocks are freed now and the next step reports `abort`."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._pending.append(self._output(seq))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- stepping --------------------------------------------------------------------------------

    def decode_steps_ahead(self) -> int:
        """How many of the next steps are plain decode steps (worker.scheduler) that `step(n)` can take at once:
        0 unless the runner is the sim runner."""
        if not isinstance(self.runner, SimRunner) or self._pending:
            return 0
        return self.scheduler.decode_steps_ahead()

    def step(self, num_steps: int = 1) -> list[RequestOutput]:
        """One scheduler step: outputs for every request that got a token (or was aborted since). `num_steps` > 1
        takes that many plain decode steps at once (at most `decode_steps_ahead()`): the same tokens, books and
        clock as that many single steps, one output per running request."""
        if num_steps > 1:
            return self._plain_decode_steps(num_steps)
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            seq.timings.preemptions += 1
        if not batch.seqs:
            return outputs
        scheduled_at = self.clock.now()
        for item in batch.seqs:
            timings = item.seq.timings
            if timings.first_scheduled is None:
                timings.first_scheduled = scheduled_at
            if item.num_new_tokens == 1 and item.seq.num_output_tokens:
                timings.decode_steps += 1
            else:
                timings.prefill_steps += 1
        sampled = self.runner.run(batch)
        advanced = self.scheduler.update(batch, sampled.token_ids, sampled.logprobs)
        sampled_at = self.clock.now()
        for seq in advanced:
            if seq.timings.first_token is None:
                seq.timings.first_token = sampled_at
            seq.timings.last_token = sampled_at
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(batch.num_tokens)
        if sampled.top_logprobs:  # one entry per sampled row, in the order `advanced` has them
            for seq, top in zip(advanced, sampled.top_logprobs, strict=True):
                if top is not None:
                    seq.output_top_logprobs.append(top)
        self.generation_tokens_total += len(advanced)
        outputs.extend(self._output(seq) for seq in advanced)
        return outputs

    def _plain_decode_steps(self, num_steps: int) -> list[RequestOutput]:
        runner = self.runner
        if not isinstance(runner, SimRunner) or self._pending:
            raise ValueError(f"{num_steps} plain decode steps asked, 0 ahead")
        advanced = self.scheduler.advance_decodes(num_steps, runner.sample_run)  # it checks the steps ahead
        runner.spend_decode_steps(num_steps)
        now = self.clock.now()
        for seq in advanced:
            seq.timings.decode_steps += num_steps
            seq.timings.last_token = now
        self.num_steps += num_steps
        if self.on_step is not None:
            for _ in range(num_steps):
                self.on_step(len(advanced))
        self.generation_tokens_total += num_steps * len(advanced)
        return [self._output(seq) for seq in advanced]

    def _output(self, seq: Sequence) -> RequestOutput:
        # Sliced from token_ids: output_token_ids would copy the whole output at every step.
        new_tokens = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted :]
        new_logprobs = seq.output_logprobs[seq.num_emitted :] if seq.params.logprobs else []
        new_top_logprobs = seq.output_top_logprobs[seq.num_emitted :]
        seq.num_emitted = seq.num_output_tokens
        finished = seq.is_finished
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            new_top_logprobs=new_top_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            timings=seq.timings if finished else None,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run every prompt to completion together (continuous batching); results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequest("params", f"{len(params_list)} sampling params for {len(prompts)} prompts")
        batch_id = next(self._ids)
        ids = [f"generate-{batch_id}-{i}" for i in range(len(prompts))]
        for prompt, p in zip(prompts, params_list, strict=True):
            self.validate_request(prompt, p)  # all or nothing: no request is queued if one is bad
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        results: dict[str, GenerationResult] = {
            i: GenerationResult([], [], "", len(p), 0) for i, p in zip(ids, prompts, strict=True)
        }
        remaining = set(ids)
        while remaining:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.new_logprobs)
                result.top_logprobs.extend(out.new_top_logprobs)
                result.cached_tokens = out.cached_tokens
                if out.finished:
                    result.finish_reason = out.finish_reason or ""
                    remaining.discard(out.request_id)
        return [results[i] for i in ids]

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.kv_manager.pool
        tier = self.kv_manager.host_tier
        return EngineStats(
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_used_blocks,
            num_blocks_cached=pool.num_cached_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prefix_queries=self.kv_manager.stats.prefix_queries,
            prefix_hits=self.kv_manager.stats.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_preemptions_recomputed=self.scheduler.num_preemptions_recomputed,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            host_kv_blocks_total=tier.num_blocks if tier else 0,
            host_kv_blocks_cached=len(tier) if tier else 0,
            host_prefix_hits=self.kv_manager.stats.host_prefix_hits,
            host_kv_blocks_saved=tier.stats.saved if tier else 0,
            host_kv_blocks_restored=tier.stats.restored if tier else 0,
            priority_loads=self.scheduler.priority_loads(),
        )

    @torch.inference_mode()
    def prompt_logits(self, prompt_token_ids: list[int], cache_salt: str = "") -> torch.Tensor:
        """float32 logits [n, vocab] at the prompt positions one step computes: all of them, or those after the
        prompt's cached prefix (a salt no other request uses gets none). For checks and benchmarks, on an idle
        engine with a model; the request is dropped afterwards and caches nothing."""
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logits needs an idle engine: its step would carry other requests")
        if not hasattr(self.runner, "compute_logits"):
            raise RuntimeError(f"prompt_logits needs a model; {self.model_id!r} has none")
        request_id = f"prompt-logits-{next(self._ids)}"
        self.add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), cache_salt=cache_salt)
        try:
            batch = self.scheduler.schedule()
            (scheduled,) = batch.seqs
            if scheduled.start + scheduled.num_new_tokens < len(prompt_token_ids):
                raise ValueError(
                    f"a {len(prompt_token_ids)}-token prompt needs more than one step of "
                    f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
                )
            return self.runner.compute_logits(batch, every_row=True)
        finally:
            self.abort_request(request_id)
            self._pending.clear()  # the abort notice of a request nobody else knows about

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv_manager.drain_events()

    def check_invariants(self) -> None:
        """Block-pool and scheduler invariants (AssertionError on a broken one); tests call it after steps."""
        self.scheduler.check_invariants()


# Weights and tokenizers are read-only once loaded, so engines in one process (tests, the benchmark's fp32 and
# bf16 engines) share them instead of loading a model again; each engine still has its own KV cache. The layout
# (worker.model_runner.lay_out_weights) changes the model's modules, so it is part of the key: an explicit float32
# engine never runs on an `auto` engine's bf16 decode copies; so is the weight-only quantization (None: float).
@functools.lru_cache(maxsize=4)
def _load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: str,
    bf16_decode_copies: bool,
    quantization: WeightQuantization | None = None,
) -> tuple[LlamaForCausalLM, LlamaConfig]:
    from worker.model import load_model
    from worker.model_runner import lay_out_weights

    model, config = load_model(source, dtype, device, quantization)
    lay_out_weights(model, device, bf16_decode_copies)
    return model, config


@functools.lru_cache(maxsize=4)
def _load_tokenizer(source: ModelSource) -> Tokenizer:
    from worker.model import load_tokenizer

    return load_tokenizer(source)
