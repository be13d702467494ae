"""Triton kernel: scatter a step's new K and V into their cache slots, quantising to FP8 on the way in."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.attention import FP8_MAX
from kvkernels.triton_fp8 import e4m3_to_bytes, is_fp8_cache, kernel_cache_view, round_to_e4m3


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One program per new token: its [num_kv_heads, head_dim] K and V go to slot slot_mapping[token]."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
        if FP8:
            k = round_to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX))
            v = round_to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX))
            if k_cache_ptr.dtype.element_ty == tl.uint8:
                k = e4m3_to_bytes(k)
                v = e4m3_to_bytes(v)
        cache_offsets = slot * stride_cache_slot + heads * stride_cache_head + dims
        tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v: [T, num_kv_heads, head_dim] (any token/head strides, unit stride along head_dim); caches contiguous
    [num_blocks, block_size, num_kv_heads, head_dim] (a uint8 cache holds e4m3 bytes). Slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache = kernel_cache_view(k_cache), kernel_cache_view(v_cache)
    write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale,
        v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8_cache(k_cache),
        FP8_MAX=FP8_MAX,
    )
