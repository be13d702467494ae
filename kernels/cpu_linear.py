"""float32 activations times a bfloat16 weight on AVX2 + FMA (kernels/cpu_bf16_linear.cpp): the decode path of
CPUs without native bf16, where a step is bound by reading the weights (worker/model/packed_linear.py picks it).

Compiled on first use with torch's cpp_extension, like the attention kernel (kernels/cpu_backend.py), and cached
under TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kernels.cpu_backend import build_extension, missing_x86_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_bf16_linear.cpp")
REQUIRED_FLAGS = ("avx2", "fma")
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    return missing_x86_flags(REQUIRED_FLAGS)


@functools.cache
def load_kernel() -> bool:
    """Compile (or load the cached build of) the kernel and register torch.ops.kvroute_cpu_linear; False, with a
    warning, when it cannot run here."""
    reason = unsupported_reason() or build_extension("kvroute_cpu_bf16_linear", SOURCE, COMPILE_FLAGS)
    if reason is None:
        return True
    log.warning("bf16 linear kernel unavailable: %s", reason)
    return False


# A panel's 16 features in the order the kernel's widening shuffles expect (kernels/cpu_bf16_linear.cpp).
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
