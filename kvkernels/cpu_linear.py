"""float32 activations times a bfloat16 weight on AVX2 + FMA (kvkernels/cpu_bf16_linear.cpp): the decode path of
CPUs without native bf16, where a step is bound by reading the weights (worker/model/packed_linear.py picks it).

Compiled on first use with torch's cpp_extension, like the attention kernel (kvkernels/cpu_backend.py), and cached
under TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvkernels.cpu_backend import AVX2_COMPILE_FLAGS, AVX2_REQUIRED_FLAGS, load_extension, missing_x86_flags

SOURCE = Path(__file__).with_name("cpu_bf16_linear.cpp")


def unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return missing_x86_flags(AVX2_REQUIRED_FLAGS)


@functools.cache
def load_kernel() -> bool:
    """Compile (or load the cached build of) the kernel and register torch.ops.kvroute_cpu_linear; False, with a
    warning, when it cannot run here."""
    return load_extension(
        "AVX2 bf16 linear kernel", "kvroute_cpu_bf16_linear", SOURCE, AVX2_COMPILE_FLAGS, AVX2_REQUIRED_FLAGS
    )


# A panel's 16 features in the order the kernel's widening shuffles expect (kvkernels/cpu_bf16_linear.cpp).
PANEL = 16
_PANEL_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def shape_supported(in_features: int, out_features: int) -> bool:
    """The kernel's shapes: out_features a multiple of 16 (whole panels)."""
    return out_features % PANEL == 0 and in_features > 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight (any float dtype) as the kernel's bfloat16 panels [N / 16, K, 16]: rounded to bf16 once."""
    n, k = weight.shape
    panels = weight.detach().to(torch.bfloat16).view(n // PANEL, PANEL, k)[:, _PANEL_ORDER]
    return panels.transpose(1, 2).contiguous()


def bf16_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] @ W^T (+ bias float32 [N]) -> float32 [M, N], accumulated in float32, where `panels` is
    `pack_weight(W)`. Needs `load_kernel()`."""
    out = torch.empty(x.shape[0], panels.shape[0] * PANEL, dtype=torch.float32)
    torch.ops.kvroute_cpu_linear.bf16_linear(x.contiguous(), panels, bias, out)
    return out
