"""Weight-only quantized layers: `QuantizedLinear` for nn.Linear and `QuantizedEmbedding` for nn.Embedding, each
holding only its backend's packed weight (kvkernels/weight_only.py's format in the backend's layout; no float copy).

The backend, one module with the contract's `pack`, `linear`, `dequantized_linear`, `dequantize`,
`dequantize_rows`, is chosen in `weight_only_backend`: Triton on CUDA, the C++ kernel on CPUs where it loads, else
kvkernels/torch_weight_only.py. A step of more rows than the backend's `DEQUANTIZE_ABOVE_ROWS[bits]` (a prefill, a
large batch) runs its `dequantized_linear` (the weight dequantized in the activations' dtype, then the dtype's
GEMM, faster there than a decode kernel); smaller steps run its `linear`. Both take the activations in the model's
dtype and answer in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from kvkernels import torch_weight_only
from kvkernels.weight_only import QuantizedWeight

# Where a backend module does not say from how many rows dequantize-then-GEMM wins, this: a decode kernel reads
# the weight once for every row, so past a few dozen rows the GEMM's reuse of each weight wins.
DEFAULT_DEQUANTIZE_ABOVE_ROWS = 32


class WeightOnlyBackend(NamedTuple):
    module: ModuleType  # pack, linear, dequantized_linear, dequantize, dequantize_rows (kvkernels' contract)
    name: str  # e.g. "cpu_weight_only", for the start-up line
    reason: str  # why this one, e.g. "torch (dequantize + matmul): kvkernels.cpu_weight_only did not load"


def _import_backend(name: str) -> tuple[ModuleType | None, str]:
    """The backend module kvkernels.<name> with its kernel loaded, or None and why not."""
    try:
        module = importlib.import_module(f"kvkernels.{name}")
    except ImportError as exc:
        return None, f"kvkernels.{name} is not importable ({exc})"
    if not module.load_kernel():
        return None, f"kvkernels.{name}'s kernel did not load ({module.unsupported_reason() or 'see the warning'})"
    return module, ""


def weight_only_backend(device: torch.device | str) -> WeightOnlyBackend:
    """The weight-only backend for `device`: kvkernels.triton_weight_only on CUDA, kvkernels.cpu_weight_only on a
    CPU where its kernel loads (AVX2 + FMA at least), else kvkernels.torch_weight_only (dequantize + matmul)."""
    device = torch.device(device)
    preferred = {"cuda": "triton_weight_only", "cpu": "cpu_weight_only"}.get(device.type)
    if preferred is None:
        return WeightOnlyBackend(torch_weight_only, "torch_weight_only", f"no weight-only kernel for {device.type}")
    module, why_not = _import_backend(preferred)
    if module is not None:
        return WeightOnlyBackend(module, preferred, f"{preferred}'s kernel")
    return WeightOnlyBackend(torch_weight_only, "torch_weight_only", f"dequantize + matmul: {why_not}")


def dequantize_above_rows(backend: ModuleType, bits: int) -> int:
    """The step size (rows) above which the model dequantizes and runs a GEMM instead of the backend's linear."""
    return getattr(backend, "DEQUANTIZE_ABOVE_ROWS", {}).get(bits, DEFAULT_DEQUANTIZE_ABOVE_ROWS)


def _register_packed(module: nn.Module, packed: Any) -> None:
    """The packed weight's tensors as (non-persistent) buffers, so that `module.buffers()` counts them and
    a tied table shared by two modules counts once."""
    for field in dataclasses.fields(packed):
        value = getattr(packed, field.name)
        if isinstance(value, torch.Tensor):
            module.register_buffer(f"packed_{field.name}", value, persistent=False)


class QuantizedLinear(nn.Module):
    """nn.Linear's forward (x [T, in] -> [T, out]) on a weight-only quantized weight."""

    def __init__(self, packed: Any, backend: ModuleType, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed, self.backend = packed, backend
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bits, self.group_size = packed.bits, packed.group_size
        self.dequantize_above_rows = dequantize_above_rows(backend, packed.bits)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        _register_packed(self, packed)

    @classmethod
    def from_weight(
        cls, weight: QuantizedWeight, backend: ModuleType, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        return cls(backend.pack(weight), backend, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.dequantize_above_rows:
            return self.backend.dequantized_linear(x, self.packed, self.bias)
        return self.backend.linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, backend={self.backend.__name__}"
        )


@contextlib.contextmanager
def decode_arithmetic_for_every_step(model: nn.Module) -> Iterator[None]:
    """Inside, every QuantizedLinear of `model` runs its backend's `linear` (the decode steps' arithmetic) at any
    step size: a teacher-forced prefill then computes what decoding those tokens one at a time would, which is
    what `kvroute quality` compares (without it a prefill's dequantize-then-GEMM measures the weights' values
    in the activations' dtype, not the kernel that decodes). Not thread-safe: for an engine nobody else steps."""
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    saved = [layer.dequantize_above_rows for layer in layers]
    for layer in layers:
        layer.dequantize_above_rows = sys.maxsize
    try:
        yield
    finally:
        for layer, rows in zip(layers, saved, strict=True):
            layer.dequantize_above_rows = rows


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's forward (ids [T] -> [T, dim] in `dtype`) on a quantized table, row by row
    (`dequantize_rows`). With tied embeddings the lm_head is a QuantizedLinear over the same packed table."""

    def __init__(self, packed: Any, backend: ModuleType, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed, self.backend, self.dtype = packed, backend, dtype
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features
        self.bits, self.group_size = packed.bits, packed.group_size
        _register_packed(self, packed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backend.dequantize_rows(self.packed, input_ids, self.dtype)

    def tied_linear(self) -> QuantizedLinear:
        """A QuantizedLinear (the lm_head of a tied model) over this table's packed weight itself."""
        return QuantizedLinear(self.packed, self.backend)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}, "
            f"backend={self.backend.__name__}"
        )
