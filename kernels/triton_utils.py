"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton.language as tl

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
