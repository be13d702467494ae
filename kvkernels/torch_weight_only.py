"""The portable weight-only backend (the contract of kvkernels/weight_only.py's kernels, in torch ops): every linear
dequantizes the whole weight and multiplies in float. It runs on any device and is the model's path on CPUs without
the C++ kernel (kvkernels/cpu_weight_only.py) and on CUDA without Triton; it keeps the memory saving (int4 two a
byte), not the decode speed.

Layout: int8 `q` as is; int4 `q` two a byte, inputs 2j and 2j + 1 of a row in the low and high nibbles of byte j.
Scales and offsets are the format's float16 [N, K / group_size].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvkernels import weight_only
from kvkernels.weight_only import QuantizedWeight

# Without a kernel, dequantize-then-GEMM is the only path: the model takes it at every step size.
DEQUANTIZE_ABOVE_ROWS = {8: 0, 4: 0}


@dataclass(frozen=True)
class Packed:
    bits: int
    group_size: int
    out_features: int
    in_features: int
    q: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K / 2] (bits 4: inputs 2j, 2j + 1 in byte j's low, high)
    scales: torch.Tensor  # float16 [N, K / group_size]
    offsets: torch.Tensor  # float16 [N, K / group_size]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets))


def unsupported_reason() -> str | None:
    return None


def load_kernel() -> bool:
    return True


def pack(weight: QuantizedWeight) -> Packed:
    n, k = weight.shape
    q = weight.q
    if weight.bits == 4:
        if k % 2:
            raise ValueError(f"int4 packing needs an even number of input features, got {k}")
        pairs = q.reshape(n, k // 2, 2)
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    return Packed(weight.bits, weight.group_size, n, k, q.contiguous(), weight.scales, weight.offsets)


def _unpacked(packed: Packed, rows: torch.Tensor | None = None) -> QuantizedWeight:
    """The packed weight (or its `rows`) back in the exchange format, one value a byte."""
    q, scales, offsets = packed.q, packed.scales, packed.offsets
    if rows is not None:
        q, scales, offsets = q[rows], scales[rows], offsets[rows]
    if packed.bits == 4:
        q = torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], packed.in_features)
    return QuantizedWeight(packed.bits, packed.group_size, q, scales, offsets)


def dequantize(packed: Packed, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight, equal to weight_only.dequantize of the weight packed."""
    return weight_only.dequantize(_unpacked(packed), dtype)


def dequantize_rows(packed: Packed, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` (int64 [R]) of the weight, [R, K]: an embedding lookup on a quantized table."""
    return weight_only.dequantize(_unpacked(packed, rows), dtype)


def dequantized_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W dequantized in x's dtype and x's dtype's GEMM: the path for many rows."""
    return F.linear(x, dequantize(packed, x.dtype), bias)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, multiplied in float32."""
    bias32 = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), dequantize(packed, torch.float32), bias32).to(x.dtype)
