"""Triton paged decode attention: one new token per sequence, K/V read through the block table.

One program handles one (sequence, KV head, partition): the query heads that share the KV head are a
[G, head_dim] tile, so each K/V tile is loaded once for the whole group. The context is split into partitions
of PARTITION_SIZE tokens so that long contexts spread over many programs (split-KV); each partition writes its
normalised output, running max and softmax denominator, and a second kernel combines the partitions. A context
that fits in one partition is written straight to the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.triton_fp8 import kernel_cache_view
from kvkernels.triton_utils import dot_dtype, dot_precision, load_kv_tile

LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    out_ptr,  # [T, H, D], or partial outputs [num_seqs, H, num_partitions, D] fp32 when SPLIT
    max_logits_ptr,  # [num_seqs, H, num_partitions] fp32 (SPLIT only)
    exp_sums_ptr,  # [num_seqs, H, num_partitions] fp32 (SPLIT only)
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    seq_ids_ptr,  # int32 [num_seqs]: the batch index of each sequence this launch handles
    query_start_loc_ptr,  # int32 [B+1]
    seq_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_blocks]
    softmax_scale_log2,  # softmax_scale * log2(e): the kernel works with exp2
    k_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_table,
    num_partitions,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + seq_index)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = partition * PARTITION_SIZE
    if start < seq_len:
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
        token = tl.load(query_start_loc_ptr + seq)
        groups = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + groups  # [BLOCK_G]
        q_mask = (groups[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
        q_offsets = token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        q = q.to(DOT_DTYPE)

        running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denominator = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
        for tile_start in range(start, end, BLOCK_N):
            positions = tile_start + tl.arange(0, BLOCK_N)
            in_context = positions < end
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, block_table, positions, in_context, kv_head, dims, k_scale, v_scale,
                stride_cache_block, stride_cache_offset, stride_cache_head, PAGE_SIZE, HEAD_DIM, DOT_DTYPE,
            )  # fmt: skip

            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softmax_scale_log2  # [BLOCK_G, BLOCK_N]
            scores = tl.where(in_context[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.exp2(scores - new_max[:, None])
            rescale = tl.exp2(running_max - new_max)
            denominator = denominator * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            running_max = new_max

        acc = acc / denominator[:, None]
        if SPLIT:
            stats_offsets = (seq_index * GROUP * tl.num_programs(1) + heads) * num_partitions + partition
            tl.store(max_logits_ptr + stats_offsets, running_max, mask=groups < GROUP)
            tl.store(exp_sums_ptr + stats_offsets, denominator, mask=groups < GROUP)
            out_offsets = stats_offsets[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_ptr + out_offsets, acc, mask=q_mask)
        else:
            out_offsets = token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
            tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def combine_partitions_kernel(
    out_ptr,  # [T, H, D]
    partial_out_ptr,  # [num_seqs, H, num_partitions, D] fp32
    max_logits_ptr,  # [num_seqs, H, num_partitions] fp32, in log2 units
    exp_sums_ptr,
    seq_ids_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    stride_out_token,
    stride_out_head,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): weigh each partition's output by its share of the softmax,
    BLOCK_P partitions at a time with the same running rescaling as the attention loop."""
    seq_index = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + seq_index)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    partitions_used = tl.cdiv(seq_len, PARTITION_SIZE)
    first_stat = (seq_index * tl.num_programs(1) + head) * num_partitions

    running_max = tl.full([], float("-inf"), tl.float32)
    denominator = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for chunk_start in range(0, partitions_used, BLOCK_P):
        parts = chunk_start + tl.arange(0, BLOCK_P)
        used = parts < partitions_used
        max_logits = tl.load(max_logits_ptr + first_stat + parts, mask=used, other=float("-inf"))
        exp_sums = tl.load(exp_sums_ptr + first_stat + parts, mask=used, other=0.0)
        partial = tl.load(
            partial_out_ptr + (first_stat + parts)[:, None] * HEAD_DIM + dims[None, :],
            mask=used[:, None] & (dims[None, :] < HEAD_DIM),
            other=0.0,
        )
        new_max = tl.maximum(running_max, tl.max(max_logits, axis=0))
        weights = exp_sums * tl.exp2(max_logits - new_max)
        rescale = tl.exp2(running_max - new_max)
        denominator = denominator * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(partial * weights[:, None], axis=0)
        running_max = new_max
    out = (acc / denominator).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, out, mask=dims < HEAD_DIM)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition_size: int = 512,
) -> None:
    """Attention for the one new token of each sequence in seq_ids (int32 indices into the batch), written to
    out[query_start_loc[seq]]. q, out: [T, H, D] with unit stride along D; caches contiguous (uint8 = e4m3 bytes).
    max_seq_len bounds the context of every listed sequence; it sets how many partitions are launched."""
    if partition_size < 16:
        raise ValueError(f"partition_size must be >= 16 (tl.dot needs 16-wide tiles), got {partition_size}")
    num_seqs = seq_ids.numel()
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1:3]
    k_cache, v_cache = kernel_cache_view(k_cache), kernel_cache_view(v_cache)
    group = num_heads // num_kv_heads
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    split = num_partitions > 1
    block_n = min(64, triton.next_power_of_2(partition_size))
    # tl.dot needs at least 16 rows on GPUs
    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    stats_shape = (num_seqs, num_heads, num_partitions)
    partial_out = torch.empty(*stats_shape, head_dim, dtype=torch.float32, device=q.device) if split else out
    max_logits = torch.empty(stats_shape, dtype=torch.float32, device=q.device) if split else out
    exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=q.device) if split else out
    paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        partial_out,
        max_logits,
        exp_sums,
        q,
        k_cache,
        v_cache,
        seq_ids,
        query_start_loc,
        seq_lens,
        block_tables,
        softmax_scale * LOG2E,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_partitions,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        PARTITION_SIZE=partition_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    if split:
        combine_partitions_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            max_logits,
            exp_sums,
            seq_ids,
            query_start_loc,
            seq_lens,
            out.stride(0),
            out.stride(1),
            num_partitions,
            HEAD_DIM=head_dim,
            PARTITION_SIZE=partition_size,
            BLOCK_P=min(32, triton.next_power_of_2(num_partitions)),
            BLOCK_D=block_d,
        )
