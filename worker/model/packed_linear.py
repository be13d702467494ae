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

CPUs without native bf16 (AVX2 only) run float32 models, whose decode steps are bound by reading the weights:
`add_bf16_decode_weights` gives each linear a bfloat16 copy, packed in panels, that steps of at most DECODE_ROWS
rows read through kernels/cpu_bf16_linear.cpp (AVX2 + FMA, widened to float32 in registers), while larger steps
keep float32 MKL. SmolLM2's 121 matrices (layers and lm_head), MKL's float32 against the kernel, medians of 9
interleaved, 2 threads, the AVX2 emulation of docs/worker.md (`python -m loadtest.linear_bench`, two runs): 1 row
1.66-1.76x (12.5 against 22.0 ms), 2 rows 2.96-3.16x, 8 rows 2.38-2.43x, 16 rows 1.69-1.78x, 32 rows 1.11-1.42x,
64 rows 0.80-0.99x, 96 rows 0.85-0.88x. Widening the whole weight to float32 for MKL
on every step (storing bf16 only) cost 20-30% at 32 to 256 rows, so prefills keep the float32 weight: the model
takes 1.5x its float32 memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear
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


# Steps of at most this many rows read the bfloat16 copy: the kernel beats float32 MKL up to 32 rows, not at 64.
DECODE_ROWS = 32


class Bf16DecodeLinear(nn.Module):
    """A float32 nn.Linear that also keeps a bfloat16 copy of its weight: inputs of at most DECODE_ROWS rows run
    on the copy (kernels.cpu_linear.bf16_linear: float32 activations, products accumulated in float32), larger
    ones on the float32 weight. The float32 weight is the linear's own tensor, so a tied lm_head stays tied."""

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
