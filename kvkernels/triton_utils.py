"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvkernels.triton_fp8 import dequantize

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype a kernel feeds tl.dot for activations of `dtype`. The interpreter (TRITON_INTERPRET=1) runs
    tl.dot in numpy, which has no bfloat16 and multiplies the raw bits, so there bfloat16 is computed in float32."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 activations get full-precision dots (the default would round them to tf32 on the GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    positions,
    valid,
    kv_head,
    dims,
    k_scale,
    v_scale,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K and V of one KV head at `positions` of a sequence, read through its block table and dequantised:
    two [BLOCK_N, BLOCK_D] tiles, zero where `valid` is False or past HEAD_DIM."""
    blocks = tl.load(block_table + positions // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    kv_offsets = (
        blocks[:, None] * stride_cache_block
        + (positions % PAGE_SIZE)[:, None] * stride_cache_offset
        + kv_head * stride_cache_head
        + dims[None, :]
    )
    kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    return dequantize(k, k_scale).to(DOT_DTYPE), dequantize(v, v_scale).to(DOT_DTYPE)
