"""Triton prefill / extend attention over a paged cache (FlashAttention-style online softmax).

One program handles one tile of BLOCK_M new tokens of one sequence for one query head. The new tokens sit at
positions seq_len - q_len ... seq_len - 1 and are already in the cache (write_kv runs first), so all keys, the
cached prefix's and the new tokens' alike, are read through the block table: a prefix of any length, ending
mid-block, and earlier chunks of a chunked prefill need no special case. Keys before the tile's first query
position need no causal mask; only the last stretch up to the tile's last query position is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.triton_decode_attention import LOG2E
from kvkernels.triton_fp8 import kernel_cache_view
from kvkernels.triton_utils import dot_dtype, dot_precision, load_kv_tile


@triton.jit
def attend_tile(
    acc,
    running_max,
    denominator,
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    query_positions,
    key_start,
    key_end,
    kv_head,
    k_scale,
    v_scale,
    softmax_scale_log2,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys [key_start, key_end) into the running softmax state of one query tile."""
    dims = tl.arange(0, BLOCK_D)
    for tile_start in range(key_start, key_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_range = positions < key_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, positions, in_range, kv_head, dims, k_scale, v_scale,
            stride_cache_block, stride_cache_offset, stride_cache_head, PAGE_SIZE, HEAD_DIM, DOT_DTYPE,
        )  # fmt: skip

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softmax_scale_log2  # [BLOCK_M, BLOCK_N]
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (positions[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        denominator = denominator * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        running_max = new_max
    return acc, running_max, denominator


@triton.jit
def paged_prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    seq_ids_ptr,  # int32 [num_seqs]: the batch index of each sequence this launch handles
    query_start_loc_ptr,  # int32 [B+1]
    seq_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_blocks]
    softmax_scale_log2,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    query_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) tiles first: a shorter tail
    seq = tl.load(seq_ids_ptr + tl.program_id(1))
    head = tl.program_id(2)
    kv_head = head // GROUP
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if query_tile * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix_len = seq_len - query_len
        rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        tokens = (query_start + rows).to(tl.int64)
        io_mask = (rows[:, None] < query_len) & (dims[None, :] < HEAD_DIM)
        q_offsets = tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
        q = q.to(DOT_DTYPE)
        query_positions = prefix_len + rows

        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denominator = tl.zeros([BLOCK_M], tl.float32)
        block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
        first_query_position = prefix_len + query_tile * BLOCK_M
        unmasked_end = (first_query_position // BLOCK_N) * BLOCK_N
        masked_end = tl.minimum(first_query_position + BLOCK_M, seq_len)
        acc, running_max, denominator = attend_tile(
            acc, running_max, denominator, q, k_cache_ptr, v_cache_ptr, block_table, query_positions,
            0, unmasked_end, kv_head, k_scale, v_scale, softmax_scale_log2,
            stride_cache_block, stride_cache_offset, stride_cache_head,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, False, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        acc, running_max, denominator = attend_tile(
            acc, running_max, denominator, q, k_cache_ptr, v_cache_ptr, block_table, query_positions,
            unmasked_end, masked_end, kv_head, k_scale, v_scale, softmax_scale_log2,
            stride_cache_block, stride_cache_offset, stride_cache_head,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D, True, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        out = acc / denominator[:, None]
        out_offsets = tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention for the new tokens of each sequence in seq_ids (int32 indices into the batch), whose K/V are
    already in the cache. q, out: [T, H, D] with unit stride along D; caches contiguous (uint8 = e4m3 bytes).
    max_query_len bounds the new-token count of every listed sequence."""
    num_seqs = seq_ids.numel()
    if num_seqs == 0:
        return
    num_heads, head_dim = q.shape[1:]
    page_size, num_kv_heads = k_cache.shape[1:3]
    k_cache, v_cache = kernel_cache_view(k_cache), kernel_cache_view(v_cache)
    block_d = triton.next_power_of_2(head_dim)
    # 64 x 64 tiles over 8 warps: with head_dim 128 this needs ~130 registers a thread and no spills on sm_90
    block_m = 64
    block_n = 64 if block_d <= 128 else 32
    paged_prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_heads)](
        out,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=8,
    )
