"""Choosing an attention backend by name: the one module that imports the backends.

The contract (`kvkernels.attention`) imports no backend, and each backend imports only the contract, so the
callers that pick one (the model runner, tests) import this module. Torch is imported only when a backend
is built, so `BACKEND_NAMES` is free to read for argument parsing.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvkernels.attention import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """name in {"auto", "torch", "cpu", "triton"}; auto = triton on CUDA, cpu elsewhere. "cpu" runs bfloat16
    models on the AVX-512 BF16 kernel, float32 ones on AVX2 CPUs without AVX-512 on the AVX2 float32 kernel, and
    everything else on the torch path (kvkernels/cpu_backend.py; the torch path, with a warning, also where a kernel
    cannot run). Triton needs CUDA, or TRITON_INTERPRET=1 (set
    before triton is first imported) to run its kernels on the CPU for tests."""
    import torch

    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "torch":
        from kvkernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU, got {device}")
        from kvkernels.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1), got {device}")
    from kvkernels.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
