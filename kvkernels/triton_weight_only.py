"""Activations times an int8 or int4 weight with float16 group scales (kvkernels/weight_only.py) on CUDA GPUs, in
one Triton kernel: the weight-only backend the model takes on CUDA.

The layout is the portable backend's (kvkernels/torch_weight_only.py: int8 `q` as is, int4 two a byte along K),
so packing, dequantizing, embedding lookups and the many-row path are its torch ops; only `linear` differs. Each
program computes a [BLOCK_M, BLOCK_N] tile of the output one group of K at a time: it unpacks the group's q in
registers (exact in the activations' dtype: |q| <= 128), takes one tl.dot with the activations in float32
accumulation, and applies the group's scales and offsets to the dot and to the activations' sum, so the weight is
never written back as floats:

    y[m, n] = sum_g scales[n, g] * sum_{k in g} q[n, k] x[m, k] + offsets[n, g] * sum_{k in g} x[m, k]

Tested under TRITON_INTERPRET=1 against weight_only.reference_linear (tests/test_kernels_triton.py), compiled
for sm_80 and sm_90 by kvkernels/compile_check.py, and run on a GPU by loadtest/gpu_check.sh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.torch_weight_only import Packed, dequantize, dequantize_rows, dequantized_linear, pack
from kvkernels.triton_utils import TL_DTYPES, dot_dtype, dot_precision

__all__ = [
    "DEQUANTIZE_ABOVE_ROWS",
    "Packed",
    "dequantize",
    "dequantize_rows",
    "dequantized_linear",
    "linear",
    "load_kernel",
    "pack",
]

# The kernel's tl.dot reuses each weight tile across BLOCK_M rows, so it serves prefill too; past this many rows
# cuBLAS on a dequantized weight is the safer default until loadtest/gpu_check.sh measures the crossover.
DEQUANTIZE_ABOVE_ROWS = {8: 256, 4: 256}
BLOCK_M = 16  # tl.dot's smallest M; a decode step's few rows are masked
BLOCK_N = 64


def unsupported_reason() -> str | None:
    return None


def load_kernel() -> bool:
    return True


@triton.jit
def weight_only_linear_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    offsets_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W^T (+ bias), W the packed weight; K a multiple of GROUP_SIZE (the format's rule)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_SIZE)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_cols = q_ptr + cols.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K // GROUP_SIZE):
        k = group * GROUP_SIZE + ks
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        if BITS == 8:
            q = tl.load(q_cols + k[:, None], mask=col_ok[None, :], other=0).to(tl.float32)
        else:
            byte = tl.load(q_cols + (k // 2)[:, None], mask=col_ok[None, :], other=0).to(tl.int32)
            q = ((byte >> ((k % 2) * 4)[:, None]) & 0x0F).to(tl.float32)
        dot = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        scale = tl.load(scales_ptr + cols.to(tl.int64) * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
        offset = tl.load(offsets_ptr + cols.to(tl.int64) * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
        acc += dot * scale[None, :] + tl.sum(x, axis=1)[:, None] * offset[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) @ W^T (+ bias) -> [M, N] in x's dtype, accumulated in float32."""
    if x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"x must be [M, {packed.in_features}], got {list(x.shape)}")
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    x = x.contiguous()
    m, n = x.shape[0], packed.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    weight_only_linear_kernel[grid](
        x,
        packed.q,
        packed.scales,
        packed.offsets,
        out if bias is None else bias,
        out,
        m,
        n,
        packed.in_features,
        x.stride(0),
        packed.q.stride(0),
        packed.scales.stride(0),
        out.stride(0),
        BITS=packed.bits,
        GROUP_SIZE=packed.group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_DTYPE=dot_dtype(x.dtype),
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out
