"""Weight-only quantized linear layers: the one exchange format between the loaders that make quantized weights
(GGUF blocks, per-group quantization of float weights) and the kernels that multiply by them (C++ on CPUs,
Triton on CUDA), and the torch reference every kernel is tested against.

A `QuantizedWeight` stands for a [N, K] weight (N output features, K input features) as

    W[n, k] = scales[n, k // group_size] * q[n, k] + offsets[n, k // group_size]

- bits 8: `q` is int8 [N, K] in -128..127; a symmetric weight has zero offsets (GGUF Q8_0).
- bits 4: `q` is uint8 [N, K] in 0..15, one value a byte (kernels pack two a byte in their own layouts);
  a symmetric weight has offsets -8 * scales (GGUF Q4_0), an asymmetric one its group minimums (GGUF Q4_1).
- `scales` and `offsets` are float16 [N, K / group_size], as GGUF stores them; the products are computed in
  float32.

Groups run along K, the reduction, so a kernel can sum q * x over a group in float32 and apply the group's scale
once: y[m, n] = sum_g scales[n, g] * sum_{k in g} q[n, k] x[m, k] + offsets[n, g] * sum_{k in g} x[m, k].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
_Q_DTYPES = {8: torch.int8, 4: torch.uint8}
_Q_RANGES = {8: (-128, 127), 4: (0, 15)}


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    group_size: int
    q: torch.Tensor  # int8 (bits 8) or uint8 (bits 4) [N, K]
    scales: torch.Tensor  # float16 [N, K / group_size]
    offsets: torch.Tensor  # float16 [N, K / group_size]

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.q.dim() != 2 or self.q.dtype != _Q_DTYPES[self.bits]:
            raise ValueError(f"q must be a 2-D {_Q_DTYPES[self.bits]} tensor for {self.bits} bits, got {self.q.dtype}")
        n, k = self.q.shape
        check_group_size(k, self.group_size)
        groups = (n, k // self.group_size)
        for name in ("scales", "offsets"):
            tensor = getattr(self, name)
            if tuple(tensor.shape) != groups or tensor.dtype != torch.float16:
                raise ValueError(f"{name} must be float16 {list(groups)}, got {tensor.dtype} {list(tensor.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def nbytes(self) -> int:
        """Bytes of the format at its own width: bits / 8 a weight plus 4 a group (what a kernel layout keeps)."""
        n, k = self.shape
        return n * k * self.bits // 8 + 2 * self.scales.numel() * 2


def check_group_size(in_features: int, group_size: int) -> None:
    """Raise ValueError unless `group_size` is one of GROUP_SIZES and divides `in_features`."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"group size {group_size} does not divide a layer's {in_features} input features; choose one that does"
        )


def quantize(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round a float [N, K] weight to `bits` with one float16 scale (and offset) per group of `group_size` inputs.

    Symmetric: scale = max|w| / 127 (bits 8) or / 7 (bits 4, q - 8 in -8..7), offsets 0 or -8 * scale.
    Asymmetric: scale = (max - min) / (2**bits - 1), offset = min, q = round((w - min) / scale), for bits 4;
    for bits 8, q is centred on -128..127 with offset = min + 128 * scale.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    n, k = weight.shape
    check_group_size(k, group_size)
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    lo, hi = _Q_RANGES[bits]
    if symmetric:
        half = 127.0 if bits == 8 else 7.0
        scales = (w.abs().amax(dim=-1) / half).to(torch.float16)
        zero_point = 0.0 if bits == 8 else 8.0
        offsets = (-zero_point * scales.to(torch.float32)).to(torch.float16)
    else:
        w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((w_max - w_min) / float(hi - lo)).to(torch.float16)
        offsets = (w_min - lo * scales.to(torch.float32)).to(torch.float16)
    s = scales.to(torch.float32).unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round((w - offsets.to(torch.float32).unsqueeze(-1)) / safe).clamp(lo, hi)
    return QuantizedWeight(bits, group_size, q.reshape(n, k).to(_Q_DTYPES[bits]), scales, offsets)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight the format stands for, computed in float32, in `dtype`."""
    n, k = weight.shape
    q = weight.q.to(torch.float32).reshape(n, k // weight.group_size, weight.group_size)
    w = q * weight.scales.to(torch.float32).unsqueeze(-1) + weight.offsets.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in float64 from the float32 weight: the reference the kernels are held to."""
    out = x.to(torch.float64) @ dequantize(weight).to(torch.float64).T
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out
