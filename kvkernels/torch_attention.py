"""Paged attention in plain torch: the engine's CPU path and the reference for the Triton kernels on CUDA.

Speed on CPU comes from doing few, large operations per layer:
- K/V are gathered a whole block at a time (k_cache[block_table]), never slot by slot, into buffers the backend
  keeps: a fresh multi-megabyte tensor per layer costs more in page faults than the copy itself;
- all single-token sequences (decodes) run as one masked SDPA over K/V padded to the longest of them, with the
  query heads of a KV head folded into SDPA's query-length axis, so GQA needs no repeated K/V;
- a sequence with several new tokens runs one causal SDPA over its own context when it has no cached prefix.
  Over a cached prefix (an extend) it runs two, merged by their logsumexp: the new tokens against the prefix
  with no mask, and against themselves with `is_causal`. On CPU that is about 10% faster than one SDPA with a
  bottom-right causal mask (SmolLM2, 404 new tokens over 3,300: 18.8 vs 21.3 ms a layer), and it runs in
  float32, which costs SDPA on CPU no more time than bfloat16 and rounds once instead of twice.
The gather plan depends only on the step's metadata, so it is built once per step and reused in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvkernels.attention import FP8_DTYPE, AttentionMetadata, to_cache_dtype


@dataclass
class DecodePlan:
    """All single-token sequences of the step, their contexts padded to the longest, context_len."""

    rows: torch.Tensor  # int64 [Bd]: row of each seq's token in q
    block_tables: torch.Tensor  # int64 [Bd, ceil(context_len / block_size)]
    context_len: int
    mask: torch.Tensor | None  # bool [Bd, 1, 1, context_len], True = a real position; None when all are real
    covers_all_rows: bool  # the rows are exactly 0..T-1, so the output needs no scatter


@dataclass
class PrefillPlan:
    """One sequence with several new tokens (a prefill chunk or an extend over a cached prefix)."""

    start: int
    end: int
    seq_len: int
    block_table: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    prefix_len: int  # context tokens before the new ones (cached or from earlier chunks); 0 = plain causal
    mask: torch.Tensor | None  # off CPU, an extend's bool [q_len, seq_len] bottom-right causal mask; else None


@dataclass
class StepPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def build_step_plan(meta: AttentionMetadata, block_size: int) -> StepPlan:
    device = meta.block_tables.device
    block_tables = meta.block_tables.long()
    starts = [0]
    for q_len in meta.query_lens_cpu:
        starts.append(starts[-1] + q_len)
    decode_seqs = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    decode = None
    if decode_seqs:
        context_lens = [meta.seq_lens_cpu[i] for i in decode_seqs]
        context_len = max(context_lens)
        index = torch.tensor(decode_seqs, device=device)
        mask = None
        if min(context_lens) < context_len:  # SDPA without a mask is faster: skip it when every seq is as long
            positions = torch.arange(context_len, device=device)
            mask = (positions[None, :] < meta.seq_lens[index].long()[:, None])[:, None, None, :]
        rows = [starts[i] for i in decode_seqs]
        decode = DecodePlan(
            rows=torch.tensor(rows, device=device),
            block_tables=block_tables[index, : -(-context_len // block_size)],
            context_len=context_len,
            mask=mask,
            covers_all_rows=rows == list(range(starts[-1])),
        )
    prefills = []
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len == 1:
            continue
        seq_len = meta.seq_lens_cpu[i]
        mask = None
        if q_len < seq_len and device.type != "cpu":  # on CPU, extend_attention needs no mask
            query_positions = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]
        table = block_tables[i, : -(-seq_len // block_size)]
        prefills.append(PrefillPlan(starts[i], starts[i + 1], seq_len, table, seq_len - q_len, mask))
    return StepPlan(decode, prefills)


def step_plan(meta: AttentionMetadata, block_size: int) -> StepPlan:
    key = ("torch_step_plan", block_size)
    if key not in meta.derived:
        meta.derived[key] = build_step_plan(meta, block_size)
    return meta.derived[key]


class Workspace:
    """Named buffers that grow to the largest size asked for and are reused from layer to layer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        numel = math.prod(shape)
        if key not in self.buffers or self.buffers[key].numel() < numel:
            self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffers[key][:numel].view(shape)


def gather_blocks(
    cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype, scale: float, workspace: Workspace, name: str
) -> torch.Tensor:
    """cache[block_table] as `dtype` (FP8 dequantised with `scale`), flattened to token positions:
    [*block_table.shape[:-1], num_blocks * block_size, Hkv, D]. The result lives in the workspace buffer `name`."""
    index = block_table.reshape(-1)
    shape = (index.numel(), *cache.shape[1:])
    if cache.dtype == dtype:
        blocks = torch.index_select(cache, 0, index, out=workspace.get(name, shape, dtype, cache.device))
    else:
        staged = torch.index_select(cache, 0, index, out=workspace.get(name, shape, cache.dtype, cache.device))
        blocks = workspace.get(name, shape, dtype, cache.device).copy_(staged)
        if cache.dtype == FP8_DTYPE:
            blocks.mul_(scale)  # exact as float32 would be: e4m3 values convert to 16/32-bit floats exactly
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self.workspace = Workspace()

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        # The engine's steps have no -1 slot (AttentionMetadata.build): one min() spares every layer three
        # boolean-mask gathers, 1.4 ms of a 25 ms SmolLM2 decode step on 2 AVX2 cores.
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:
            valid = slot_mapping >= 0
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        # index_put, not index_copy_: the latter has no float8 kernel on CPU.
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = to_cache_dtype(k, k_cache.dtype, k_scale)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = to_cache_dtype(v, v_cache.dtype, v_scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        plan = step_plan(meta, k_cache.shape[1])
        scales = (softmax_scale, k_scale, v_scale)
        if plan.decode is not None and plan.decode.covers_all_rows:
            return self._decode(q, k_cache, v_cache, plan.decode, *scales)
        out = torch.empty_like(q)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode(q[plan.decode.rows], k_cache, v_cache, plan.decode, *scales)
        for seq in plan.prefills:
            out[seq.start : seq.end] = self._prefill(q[seq.start : seq.end], k_cache, v_cache, seq, *scales)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        softmax_scale: float,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        k = gather_blocks(k_cache, plan.block_tables, q.dtype, k_scale, self.workspace, "k")  # [Bd, L, Hkv, D]
        v = gather_blocks(v_cache, plan.block_tables, q.dtype, v_scale, self.workspace, "v")
        k, v = k[:, : plan.context_len].transpose(1, 2), v[:, : plan.context_len].transpose(1, 2)
        # The G query heads sharing a KV head act as G query positions of that head: [Bd, Hkv, G, D].
        q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=softmax_scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PrefillPlan,
        softmax_scale: float,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        split_extend = plan.prefix_len > 0 and plan.mask is None
        dtype = torch.float32 if split_extend else q.dtype
        k = gather_blocks(k_cache, plan.block_table, dtype, k_scale, self.workspace, "k")[: plan.seq_len]
        v = gather_blocks(v_cache, plan.block_table, dtype, v_scale, self.workspace, "v")[: plan.seq_len]
        # 4-D inputs ([1, H, S, D]): with 3-D ones CPU torch falls back to its slow math kernel.
        q4 = q.to(dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, S, D]
        if split_extend:
            out = extend_attention(q4, k, v, plan.prefix_len, softmax_scale)
        else:
            out = F.scaled_dot_product_attention(
                q4, k, v, attn_mask=plan.mask, is_causal=plan.mask is None, scale=softmax_scale, enable_gqa=True
            )
        return out[0].transpose(0, 1).to(q.dtype)


def extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, softmax_scale: float
) -> torch.Tensor:
    """Causal attention of q_len new tokens that follow `prefix_len` context tokens: q [1, H, q_len, D],
    k, v [1, Hkv, prefix_len + q_len, D] -> [1, H, q_len, D]. Every new token sees the whole prefix (one
    unmasked SDPA) and the new tokens up to itself (one causal SDPA); the two softmaxes merge exactly through
    their logsumexps."""
    _, num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Over the prefix no mask is needed, so the `group` query heads of a KV head fold into one head of
    # group * q_len queries and K/V are not repeated.
    folded = q.reshape(1, num_kv_heads, group * q_len, head_dim)
    out_prefix, lse_prefix = _flash_attention(folded, k[:, :, :prefix_len], v[:, :, :prefix_len], False, softmax_scale)
    k_new = k[:, :, prefix_len:].repeat_interleave(group, dim=1)  # [1, H, q_len, D]
    v_new = v[:, :, prefix_len:].repeat_interleave(group, dim=1)
    out_new, lse_new = _flash_attention(q, k_new, v_new, True, softmax_scale)
    out_prefix = out_prefix.reshape(1, num_heads, q_len, head_dim)
    lse_prefix = lse_prefix.reshape(1, num_heads, q_len, 1)
    lse_new = lse_new.reshape(1, num_heads, q_len, 1)
    lse = torch.logaddexp(lse_prefix, lse_new)
    return out_prefix * torch.exp(lse_prefix - lse) + out_new * torch.exp(lse_new - lse)


def _flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel, which also returns the logsumexp of each query's scores: out [1, H, L, D],
    lse float32 [1, H, L]. Same number of heads in q, k and v."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=softmax_scale)
    return out, lse
