"""Linear layers on the CPU through oneDNN, with their weights reordered once, at load, into its blocked layout.

- `pack_linears` replaces bf16 and float32 nn.Linears by `PackedLinear`s where `packing_supported()` (the CPU
  multiplies bf16 natively): `F.linear` on a plain weight makes oneDNN reorder it on every call. bf16 results are
  bit-identical to `F.linear`'s; float32 ones differ from MKL's by summation order only (relative 1e-6). The ops
  are the ones torch's own CPU compiler (inductor) uses for frozen linears.
- `add_bf16_decode_weights`, for CPUs without native bf16 that have AVX2 and FMA (float32 models): each float32
  linear keeps its weight and gains a bfloat16 copy, packed in panels, that steps of at most DECODE_ROWS rows read
  through kvkernels/cpu_bf16_linear.cpp (widened to float32 in registers, float32 accumulation); larger steps run
  float32 MKL. The model then takes 1.5x its float32 memory.

What each measured, and why packing is off without native bf16: docs/worker.md, "Linear layers on CPUs".
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvkernels import cpu_linear
from kvkernels.cpu_backend import native_bf16

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight reordered for oneDNN (bf16 or fp32); the original weight is not kept."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_supported() -> bool:
    """oneDNN in this torch build, on a CPU that multiplies bf16 natively (kvkernels.cpu_backend.native_bf16, which
    honours $KVROUTE_CPU_HIDE_FLAGS) and that oneDNN agrees can run bf16. Elsewhere packing does not pay (see
    above), for float32 either."""
    if not native_bf16()[0]:
        return False
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 or fp32 nn.Linear on the CPU in `model` by a PackedLinear; returns how many were
    packed. Does nothing (returns 0) where `packing_supported()` is False."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype in PACKED_DTYPES and child.weight.device.type == "cpu"
    ]
    if not targets or not packing_supported():
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    log.debug("packed %d linear layers for oneDNN", len(targets))
    return len(targets)


# Steps of at most this many rows read the bfloat16 copy: the kernel beats float32 MKL up to 32 rows, not at 64.
DECODE_ROWS = 32


class Bf16DecodeLinear(nn.Module):
    """A float32 nn.Linear that also keeps a bfloat16 copy of its weight: inputs of at most DECODE_ROWS rows run
    on the copy (kvkernels.cpu_linear.bf16_linear: float32 activations, products accumulated in float32), larger
    ones on the float32 weight. The float32 weight is the linear's own tensor, so a tied lm_head stays tied."""

    weight_panels: torch.Tensor  # a registered buffer

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_panels", cpu_linear.pack_weight(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= DECODE_ROWS:
            return cpu_linear.bf16_linear(x, self.weight_panels, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def bf16_decode_weights_supported() -> str | None:
    """Why `add_bf16_decode_weights` would not pay or run here, or None when it does: only CPUs without native
    bf16 (with it, bf16 models run natively) that have AVX2 and FMA."""
    if native_bf16()[0]:
        return "the CPU multiplies bf16 natively"
    return cpu_linear.unsupported_reason()


def add_bf16_decode_weights(model: nn.Module) -> int:
    """Replace every float32 nn.Linear on the CPU in `model` whose shape the kernel takes by a Bf16DecodeLinear;
    returns how many. Call only where `bf16_decode_weights_supported()` is None; returns 0 when the kernel does
    not build (with its warning)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
        and cpu_linear.shape_supported(child.in_features, child.out_features)
    ]
    if not targets or not cpu_linear.load_kernel():
        return 0
    for parent, name, child in targets:
        setattr(parent, name, Bf16DecodeLinear(child))
    log.debug("gave %d linear layers a bfloat16 copy for decode steps", len(targets))
    return len(targets)
