"""A float32 decoder layer's small ops on AVX2 + FMA, each one pass (kvkernels/cpu_fused_ops.cpp): RMSNorm, the
residual add fused with the next RMSNorm, SiLU(gate) * up, and RoPE in place. worker/model/llama.py takes them
for float32 activations on a CPU that has the instructions (`available`); elsewhere, and for bf16 (which keeps
HF's roundings), torch's ops run.

Compiled on first use with torch's cpp_extension, like the attention kernels (kvkernels/cpu_backend.py), and
cached under TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvkernels.cpu_backend import AVX2_COMPILE_FLAGS, AVX2_REQUIRED_FLAGS, load_extension, missing_x86_flags

SOURCE = Path(__file__).with_name("cpu_fused_ops.cpp")


def unsupported_reason() -> str | None:
    """Why this machine cannot run the ops, or None when it can."""
    return missing_x86_flags(AVX2_REQUIRED_FLAGS)


@functools.cache
def load_kernel() -> bool:
    """Compile (or load the cached build of) the ops and register torch.ops.kvroute_cpu_fused; False, with a
    warning, when they cannot run here."""
    return load_extension("fused CPU ops", "kvroute_cpu_fused_ops", SOURCE, AVX2_COMPILE_FLAGS, AVX2_REQUIRED_FLAGS)


def available(x: torch.Tensor) -> bool:
    """Whether the ops serve this activation: float32 on a CPU whose ops loaded."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and load_kernel()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] / sqrt(mean(x^2) + eps) * weight [n], as a new tensor."""
    out = torch.empty_like(x)
    torch.ops.kvroute_cpu_fused.rms_norm(x, weight, eps, out)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (both [T, n], rows contiguous)."""
    torch.ops.kvroute_cpu_fused.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    torch.ops.kvroute_cpu_fused.silu_and_mul(gate_up, out)
    return out


def rope_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate-half RoPE in place on x [T, H, D] (heads contiguous within a token), from a table [max_pos, D] of
    cos in the first D / 2 columns and sin after, at positions int64 [T]."""
    torch.ops.kvroute_cpu_fused.rope(x, cos_sin, positions)
