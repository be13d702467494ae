"""Linear layers on the CPU through oneDNN, with their weights reordered once, at load, into its blocked layout.

- bfloat16: `F.linear` on a plain weight makes oneDNN reorder that weight on every call, which costs about as
  much as the multiplication itself for one token. Packing once speeds a decode step's matmuls up by about
  1.8x (SmolLM2's four layer matrices and its 49,152-row lm_head at T = 1), a 32-sequence batch by 1.25x and
  a prefill by 4%, with bit-identical results.
- float32: `F.linear` goes to MKL, which on this AMD CPU runs at about 215 GFLOP/s (2 threads); oneDNN runs
  the same products at about 505 (T = 404 and 2,048; 2.4x at T = 32), with float32 accumulation (results
  differ from MKL's by summation order only: relative 1e-6).
The ops are the ones torch's own CPU compiler (inductor) uses for frozen linears. Packing runs only where the CPU
multiplies bf16 natively (`packing_supported`): with oneDNN capped to AVX2, packed float32 ran 1.3x slower than
MKL at 2,048 rows and 1.6x slower at one row (SmolLM2's four layer matrices).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.cpu_backend import native_bf16

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
    """oneDNN in this torch build, on a CPU that multiplies bf16 natively (kernels.cpu_backend.native_bf16, which
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
