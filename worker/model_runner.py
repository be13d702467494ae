"""The model runner turns a scheduled step into sampled tokens: it owns the weights, the paged KV cache and
the sampler. `StepRunner` is the interface the engine drives; `ModelRunner` runs a real model and
`worker.sim_runner.SimRunner` stands in for one.

KV cache size. Each layer has a K and a V tensor of shape [num_blocks, block_size, num_kv_heads, head_dim], so

    num_blocks = memory / (2 * num_layers * block_size * num_kv_heads * head_dim * bytes_per_element)

with 4 bytes per element for float32, 2 for bfloat16 and 1 for FP8 (e4m3): FP8 holds twice the blocks of
bf16 in the same memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvkernels.attention import FP8_DTYPE, AttentionBackend, AttentionMetadata, token_positions
from kvkernels.backend_select import get_attention_backend
from kvkernels.cpu_backend import CpuAttentionBackend, native_bf16
from worker.config import EngineConfig
from worker.cpu_memory import keep_freed_memory
from worker.host_kv_tier import CopyCostMeter, check_host_memory, host_tier_blocks
from worker.model.config import LlamaConfig
from worker.model.llama import LlamaForCausalLM, OutputRows
from worker.model.packed_linear import (
    DECODE_ROWS,
    Bf16DecodeLinear,
    add_bf16_decode_weights,
    bf16_decode_weights_supported,
    pack_linears,
)
from worker.model.weight_quantization import WeightQuantization, describe_weights
from worker.sampler import Sampler, SamplerOutput
from worker.scheduler import SchedulerOutput

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StepRunner(Protocol):
    """Runs one scheduled step. `run` returns one token (and its logprob) per `batch.sampling` entry,
    in that order."""

    num_kv_blocks: int

    def run(self, batch: SchedulerOutput) -> SamplerOutput: ...

    def warm_up(self) -> None:
        """Do the one-time work (kernel builds, JIT) that would otherwise land on the first request."""
        ...


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    reason: str  # one line for the startup log and GetInfo, e.g. "auto: float32, the CPU has no native bf16 ..."


def resolve_dtype(name: str, model_kind: str, device: str | torch.device = "cpu") -> DtypeChoice:
    """The weights' dtype, and why (the reason is logged and in GetInfo). An explicit `name` is taken as asked
    (bfloat16 on a CPU without native bf16 says it is emulated). `auto` is a dtype the machine multiplies
    natively: on a CPU, bfloat16 where kvkernels.cpu_backend.native_bf16 says so, else float32; on CUDA, bfloat16
    where the GPU supports it, else float32; float32 on other devices. The tiny test model's `auto` is float32,
    its native dtype: its random weights give near-tied logits, so bf16 rounding would let batch shape or
    attention backend decide its greedy tokens. Why, measured: docs/worker.md, "The dtype the engine picks"."""
    device = torch.device(device)
    if name != "auto":
        dtype = TORCH_DTYPES[name]
        if dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16()[0]:
            return DtypeChoice(dtype, f"bfloat16 as asked, though the CPU has {native_bf16()[1]}: torch emulates it")
        return DtypeChoice(dtype, f"{name} as asked")
    if model_kind == "tiny":
        return DtypeChoice(torch.float32, "auto: float32, the tiny test model's own dtype")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, f"auto: bfloat16, {gpu} supports it")
        return DtypeChoice(torch.float32, f"auto: float32, {gpu} has no bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: float32 on {device.type}")
    native, flags = native_bf16()
    if native:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, the CPU multiplies it natively ({flags})")
    reason = f"auto: float32, the CPU has no native bf16 ({flags})"
    if bf16_decode_weights_supported() is None:
        reason += f"; steps of <= {DECODE_ROWS} tokens read bfloat16 copies of the linear weights"
    return DtypeChoice(torch.float32, reason)


def uses_bf16_decode_weights(config: EngineConfig, dtype: torch.dtype) -> bool:
    """Whether the runner gives the float32 linears bfloat16 copies for decode-sized steps
    (worker/model/packed_linear.py): where `auto` took float32 on a CPU without native bf16 that has AVX2 and FMA.
    Decode there is bound by reading the weights; prefills keep the float32 weights. Not for an explicit float32
    (the reference checks run it), nor for the tiny test model (see resolve_dtype), nor under `--weights int8|int4`."""
    return (
        config.dtype == "auto"
        and config.weights in ("auto", "float")
        and config.model != "tiny"
        and dtype == torch.float32
        and torch.device(config.device).type == "cpu"
        and bf16_decode_weights_supported() is None
    )


def weight_quantization(config: EngineConfig) -> WeightQuantization | None:
    """The weight-only quantization `--weights` asks for (worker/model/weight_quantization.py); None for auto
    and float, today's float weights in the model's dtype."""
    return WeightQuantization.from_flags(config.weights, config.weight_group_size, config.weight_scheme)


def lay_out_weights(model: LlamaForCausalLM, device: str | torch.device, bf16_decode_copies: bool) -> None:
    """Put a freshly loaded model's weights in this CPU's layout, in place (worker/model/packed_linear.py): oneDNN
    packing where the CPU multiplies bf16 natively, and with `bf16_decode_copies` (`uses_bf16_decode_weights`)
    bfloat16 copies for decode steps. Nothing on other devices. The model's modules change, so a model laid out
    one way must not serve an engine that expects another."""
    if torch.device(device).type != "cpu":
        return
    pack_linears(model)
    if bf16_decode_copies:
        add_bf16_decode_weights(model)


def describe_attention(backend: AttentionBackend, dtype: torch.dtype, head_dim: int) -> str:
    """The attention path a model of this dtype takes on `backend`, and why where the backend has a choice."""
    if isinstance(backend, CpuAttentionBackend):
        return backend.describe(dtype, head_dim)
    return backend.name


def kv_bytes_per_block(config: LlamaConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    element_size = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


def block_words(cache: torch.Tensor) -> torch.Tensor:
    """A KV cache [blocks, ...] as [blocks, words]: 8-byte words where a block's bytes divide by 8 (copying whole
    blocks by words ran 7x faster than by bytes, 11.5 against 1.6 GB/s on 6 KB blocks), else bytes."""
    rows = cache.flatten(1)
    return rows.view(torch.int64) if rows.shape[1] * rows.element_size() % 8 == 0 else rows.view(torch.uint8)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [N]: rows of the step's hidden states to sample from
    sampled_only: OutputRows | None  # the sample rows for the model's last layer; None when every row samples


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, model_config: LlamaConfig) -> None:
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse the heap instead of faulting in fresh pages every layer
        self.model = model
        self.model_config = model_config
        self.block_size = config.block_size
        self.dtype = next(model.parameters()).dtype
        self.bf16_decode_weights = any(isinstance(m, Bf16DecodeLinear) for m in model.modules())
        self.weights = describe_weights(model)  # e.g. "int4 g32 x 120, int8 g32 x 2 on torch_weight_only"
        self.kv_cache_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.attention_path = describe_attention(self.backend, self.dtype, model_config.head_dim)
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            memory = int(config.kv_cache_memory_gb * 2**30)
            self.num_kv_blocks = memory // kv_bytes_per_block(model_config, config.block_size, self.kv_cache_dtype)
        if self.num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no KV block for this model")
        shape = (self.num_kv_blocks, self.block_size, model_config.num_key_value_heads, model_config.head_dim)
        # Zeroed, not empty: a backend may read a whole block, and 0 * NaN from stale memory would be NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(model_config.num_hidden_layers)
        ]
        block_bytes = kv_bytes_per_block(model_config, config.block_size, self.kv_cache_dtype)
        self.num_host_kv_blocks = host_tier_blocks(config, block_bytes)
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.num_host_kv_blocks:
            check_host_memory(self.num_host_kv_blocks, block_bytes)
            host_shape = (self.num_host_kv_blocks, *shape[1:])
            pinned = self.device.type == "cuda"  # page-locked: the copies run at the link's speed
            self.host_kv_caches = [
                tuple(  # type: ignore[misc]
                    torch.empty(host_shape, dtype=self.kv_cache_dtype, pin_memory=pinned) for _ in range(2)
                )
                for _ in range(model_config.num_hidden_layers)
            ]
        self.sampler = Sampler(config.seed)
        self.copy_cost = CopyCostMeter(config.block_size)

    @torch.inference_mode()
    def copy_to_host(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        """KVBlockCopier: whole blocks, every layer's K and V, as raw words (an FP8 cache too). Timed for
        `copy_pays` (synchronous: the rows land in host memory before it returns)."""
        started = time.perf_counter()
        src = torch.tensor(device_blocks, device=self.device)
        dst = torch.tensor(host_slots)
        for device_pair, host_pair in zip(self.kv_caches, self.host_kv_caches, strict=True):
            for device_cache, host_cache in zip(device_pair, host_pair, strict=True):
                block_words(host_cache).index_copy_(0, dst, block_words(device_cache).index_select(0, src).cpu())
        self.copy_cost.observe_copy(len(device_blocks), time.perf_counter() - started)

    def copy_pays(self) -> bool:
        """KVBlockCopier: by the copies and prefills measured so far (CopyCostMeter)."""
        return self.copy_cost.copy_pays()

    @torch.inference_mode()
    def copy_from_host(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        """KVBlockCopier: the reverse of copy_to_host."""
        src = torch.tensor(host_slots)
        dst = torch.tensor(device_blocks, device=self.device)
        for device_pair, host_pair in zip(self.kv_caches, self.host_kv_caches, strict=True):
            for device_cache, host_cache in zip(device_pair, host_pair, strict=True):
                rows = block_words(host_cache).index_select(0, src).to(self.device, non_blocking=True)
                block_words(device_cache).index_copy_(0, dst, rows)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> SamplerOutput:
        started = time.perf_counter()
        logits = self.compute_logits(batch)
        sampling = batch.sampling
        if not sampling:  # only prefill chunks: the step filled the cache
            if self.device.type == "cpu":
                self._observe_prefill(batch, started)
            return SamplerOutput([], [])
        out = self.sampler(
            logits,
            [s.seq.params for s in sampling],
            [s.seq.generator(self.device) for s in sampling],
            [s.seq.suppressed_token_ids() for s in sampling],
            [s.seq.constraint for s in sampling],
        )
        self._observe_prefill(batch, started)  # the sampled ids are on the host: the step is done
        return out

    def _observe_prefill(self, batch: SchedulerOutput, started: float) -> None:
        """A step of prefill chunks only prices a token's recompute (CopyCostMeter)."""
        if self.host_kv_caches and all(s.num_new_tokens > 1 for s in batch.seqs):
            self.copy_cost.observe_prefill(batch.num_tokens, time.perf_counter() - started)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A prefill-shaped and a decode-shaped forward over the first KV blocks, before any request owns them:
        the CPU attention kernel is built or loaded and oneDNN's kernels are generated now. The blocks are
        zeroed again afterwards."""
        num_tokens = min(2 * self.block_size, self.num_kv_blocks * self.block_size)
        blocks = list(range(-(-num_tokens // self.block_size)))
        for q_len in (num_tokens, 1):
            meta = AttentionMetadata.build([q_len], [num_tokens], [blocks], self.block_size, self.device)
            positions = torch.arange(num_tokens - q_len, num_tokens, device=self.device)
            input_ids = torch.zeros(q_len, dtype=torch.int64, device=self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[-1:])
        for k_cache, v_cache in self.kv_caches:
            k_cache[blocks] = 0
            v_cache[blocks] = 0

    @torch.inference_mode()
    def compute_logits(self, batch: SchedulerOutput, every_row: bool = False) -> torch.Tensor:
        """float32 logits [N, vocab] at the last new token of each sequence in `batch.sampling`; with
        `every_row`, at every new token of the step instead."""
        inputs = self.prepare_inputs(batch)
        sampled_only = None if every_row else inputs.sampled_only
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend, sampled_only)
        if sampled_only is None and not every_row:  # every row samples (decodes): the model kept them all
            hidden = hidden[inputs.sample_rows]
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, batch: SchedulerOutput) -> StepInputs:
        """Token ids, positions and attention metadata for the step, built with a handful of tensor ops."""
        seqs = batch.seqs
        query_lens = [s.num_new_tokens for s in seqs]
        seq_lens = [s.start + s.num_new_tokens for s in seqs]
        token_ids: list[int] = []
        for s in seqs:
            token_ids.extend(s.seq.token_ids[s.start : s.start + s.num_new_tokens])
        ends = torch.cumsum(torch.tensor(query_lens), dim=0).tolist()
        sample_rows = torch.tensor([end - 1 for end, s in zip(ends, seqs, strict=True) if s.samples], dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata.build(query_lens, seq_lens, [s.block_table for s in seqs], self.block_size, dev)
        positions = token_positions(query_lens, seq_lens)
        sample_rows = sample_rows.to(dev)
        sampled_only = None
        if len(sample_rows) < len(token_ids):  # a prefill's other rows: the model's last layer can skip them
            sampling = [(seq_len, s.block_table) for seq_len, s in zip(seq_lens, seqs, strict=True) if s.samples]
            sampled_meta = None
            if sampling:  # each sampled row is its seq's last new token: a one-token query over the seq's context
                lens, tables = map(list, zip(*sampling, strict=True))
                sampled_meta = AttentionMetadata.build([1] * len(lens), lens, tables, self.block_size, dev)
            sampled_only = OutputRows(sample_rows, sampled_meta)
        return StepInputs(torch.tensor(token_ids, device=dev), positions.to(dev), meta, sample_rows, sampled_only)
