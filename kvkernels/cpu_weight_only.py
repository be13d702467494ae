"""float32 or bfloat16 activations times an int8 or int4 weight with float16 group scales (kvkernels/weight_only.py)
on x86 CPUs, through kvkernels/cpu_weight_only.cpp: the decode step of a weight-only quantized model, bound by
reading the weights, which it unpacks in registers and never writes back as floats.

One C++ source, two builds, chosen by the CPU's flags (kvkernels.cpu_backend.cpu_flags, which honours
$KVROUTE_CPU_HIDE_FLAGS) when first used: AVX-512 (F, BW, VL) where the CPU has it, else AVX2 + FMA + F16C; a CPU
with neither gets `unsupported_reason()`, and the caller runs the portable torch backend
(kvkernels/torch_weight_only.py). Compiled on first use with torch's cpp_extension, like the other CPU kernels
(kvkernels/cpu_backend.py), and cached under TORCH_EXTENSIONS_DIR.

The backend API every weight-only backend implements: `pack`, `linear` (decode steps), `dequantized_linear`
(steps of more than DEQUANTIZE_ABOVE_ROWS rows, measured for this kernel), `dequantize`, `dequantize_rows`,
`unsupported_reason`, `load_kernel`. Layout, dispatch and figures: docs/worker.md, "Weight-only linear kernels on CPUs".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvkernels.cpu_backend import load_extension, missing_x86_flags
from kvkernels.weight_only import QuantizedWeight
from kvkernels.weight_only import dequantize as dequantize_format

SOURCE = Path(__file__).with_name("cpu_weight_only.cpp")
PANEL = 16  # output features a panel (the kernel's vector of lanes); out_features must be a multiple
HEAD_BYTES = 64  # a block's 16 float16 scales and 16 float16 offsets, ahead of its q

# Steps of more rows than this (by bits) run `dequantized_linear` instead. SmolLM2 on 2 threads
# (benchmarks/weight_only_bench.py; docs/worker.md): the layer matrices alone cross over between 16 and 32 rows,
# int8 and int4 alike; the whole engine's decode step between 32 and 64 streams, which is what this follows.
DEQUANTIZE_ABOVE_ROWS: dict[int, int] = {8: 32, 4: 32}
# dequantized_linear's chunk of the float weight: small enough to be in cache when its GEMM reads it back (the
# 49,152-row lm_head dequantized whole, 56 MB, ran at a third of the speed).
DEQUANTIZE_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class KernelBuild:
    """One build of the C++ source: the instructions it is compiled for, the CPU flags they need."""

    isa: str
    required: tuple[str, ...]
    march: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"kvroute_cpu_weight_only_{self.isa}"

    @property
    def namespace(self) -> str:
        return f"kvroute_cpu_wo_{self.isa}"

    def cflags(self) -> list[str]:
        return ["-O3", *self.march, "-fopenmp", "-ffp-contract=off", f"-DKVROUTE_WO_LIBRARY={self.namespace}"]


# Richest first: a CPU runs the first whose flags it has.
BUILDS = (
    KernelBuild(
        "avx512",
        ("avx512f", "avx512bw", "avx512vl", "fma", "f16c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"),
    ),
    KernelBuild("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
)


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernel's layout: panels of 16 output features, each a run of blocks, one a group
    of inputs: the group's 16 float16 scales, 16 float16 offsets, then its q, k by k, 16 features each (int8: a
    byte each; int4: a byte a feature for a pair of k, the first in the low nibble)."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    blocks: torch.Tensor  # uint8 [N / 16, K / group_size, 64 + group_size * 2 * bits]

    def nbytes(self) -> int:
        return self.blocks.numel()


@functools.cache
def kernel_build() -> KernelBuild | None:
    """The build this CPU runs, or None where it runs neither. Read once: the hide switch holds for the process."""
    return next((build for build in BUILDS if missing_x86_flags(build.required) is None), None)


def unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel (the AVX2 build's flags it lacks), or None when it can."""
    return None if kernel_build() is not None else missing_x86_flags(BUILDS[-1].required)


@functools.cache
def load_kernel() -> bool:
    """Compile (or load the cached build of) this CPU's build and register its ops; False, with a warning, when it
    cannot run here."""
    build = kernel_build()
    if build is None:
        return False
    what = f"{build.isa} weight-only linear kernel"
    return load_extension(what, build.name, SOURCE, build.cflags(), build.required)


def pack(weight: QuantizedWeight) -> PackedWeight:
    """The kernel's layout of `weight`; ValueError unless out_features is a multiple of 16 (and int4 q in 0..15)."""
    n, k = weight.shape
    if n % PANEL:
        raise ValueError(f"the CPU weight-only kernel takes out_features a multiple of {PANEL}, got {n}")
    if weight.bits == 4 and weight.q.numel() and int(weight.q.max()) > 15:
        raise ValueError("int4 q must be in 0..15")
    group = weight.group_size
    panels, groups = n // PANEL, k // group
    # [P, 16, G] -> [P, G, 16]: a block's scales (then offsets) for its 16 features side by side.
    scales, offsets = (t.view(panels, PANEL, groups).transpose(1, 2) for t in (weight.scales, weight.offsets))
    head = torch.cat([scales, offsets], dim=-1).contiguous().view(torch.uint8)
    q = weight.q.view(torch.uint8).view(panels, PANEL, groups, group).permute(0, 2, 3, 1)  # [P, G, group, 16]
    if weight.bits == 4:
        q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)
    blocks = torch.cat([head, q.reshape(panels, groups, -1)], dim=-1).contiguous()
    return PackedWeight(weight.bits, group, n, k, blocks)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 or bfloat16 [M, K] @ W^T (+ bias [N]) -> [M, N] in x's dtype, products accumulated in float32.
    Needs `load_kernel()`."""
    out = torch.empty(x.shape[0], packed.out_features, dtype=x.dtype)
    ops = getattr(torch.ops, kernel_build().namespace)  # type: ignore[union-attr]  # load_kernel() said it runs
    bias = None if bias is None else bias.to(x.dtype)
    ops.linear(x.contiguous(), packed.blocks, packed.bits, packed.group_size, bias, out)
    return out


def dequantized_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] for steps of many rows: the weight dequantized in x's dtype a chunk of
    output features at a time (DEQUANTIZE_CHUNK_BYTES), each chunk's product by x's dtype's GEMM."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not load_kernel():
        return F.linear(x, dequantize(packed, x.dtype), bias)
    chunk = max(1, DEQUANTIZE_CHUNK_BYTES // (PANEL * packed.in_features * x.element_size()))
    outs = []
    for start in range(0, packed.blocks.shape[0], chunk):
        weight = _dequantize_panels(packed, packed.blocks[start : start + chunk], x.dtype)
        part = None if bias is None else bias[start * PANEL : start * PANEL + weight.shape[0]]
        outs.append(F.linear(x, weight, part))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole [N, K] weight in `dtype`, equal to weight_only.dequantize of the weight packed: in the C++ kernel
    for float32 and bfloat16 where it loads (a prefill's linears call this each step), else in torch ops."""
    if dtype not in (torch.float32, torch.bfloat16) or not load_kernel():
        return dequantize_format(_unpack(packed, None), dtype)
    return _dequantize_panels(packed, packed.blocks, dtype)


def _dequantize_panels(packed: PackedWeight, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks` (a run of packed.blocks' panels) as their [16 * panels, K] weight in float32 or bfloat16, by the C++
    op. Needs `load_kernel()`."""
    out = torch.empty(blocks.shape[0] * PANEL, packed.in_features, dtype=dtype)
    ops = getattr(torch.ops, kernel_build().namespace)  # type: ignore[union-attr]  # load_kernel() said it runs
    ops.dequantize(blocks, packed.bits, packed.group_size, out)
    return out


def dequantize_rows(packed: PackedWeight, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Output rows `rows` (int64 [R], each in 0..N-1) of the weight in `dtype` [R, K]: an embedding lookup on a
    table tied to the weight, equal to the same rows of `dequantize`."""
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= packed.out_features):
        raise IndexError(f"rows must be in 0..{packed.out_features - 1}")
    return dequantize_format(_unpack(packed, rows), dtype)


def _unpack(packed: PackedWeight, rows: torch.Tensor | None) -> QuantizedWeight:
    """The exchange format of the whole weight (rows None) or of output rows `rows`, read back from the blocks."""
    blocks = packed.blocks if rows is None else packed.blocks[rows // PANEL]
    panels, groups = blocks.shape[:2]
    # Lanes (features) second: heads [P, 16, 2, G] (scales, offsets), q bytes [P, 16, G, bytes a feature].
    heads = blocks[..., :HEAD_BYTES].contiguous().view(torch.float16).view(panels, groups, 2, PANEL)
    heads = heads.permute(0, 3, 2, 1)
    q = blocks[..., HEAD_BYTES:].reshape(panels, groups, -1, PANEL).permute(0, 3, 1, 2)
    if rows is None:
        heads, q = heads.flatten(0, 1), q.flatten(0, 1)
    else:
        picked = torch.arange(rows.numel())
        heads, q = heads[picked, rows % PANEL], q[picked, rows % PANEL]
    if packed.bits == 4:
        q = torch.stack([q & 15, q >> 4], dim=-1)
    q = q.reshape(heads.shape[0], packed.in_features).contiguous()
    if packed.bits == 8:
        q = q.view(torch.int8)
    return QuantizedWeight(packed.bits, packed.group_size, q, heads[:, 0].contiguous(), heads[:, 1].contiguous())
