"""The Triton weight-only linear kernel (kvkernels/triton_weight_only.py) against the format's float64 reference,
run on the CPU by Triton's interpreter (TRITON_INTERPRET is set before the kernel module is imported: triton.jit
reads it when it decorates), or on a GPU where there is one. Shapes are small: the interpreter is slow."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvkernels import triton_weight_only  # noqa: E402
from kvkernels.weight_only import QuantizedWeight, dequantize, quantize, reference_linear  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

# Relative to the output's scale: float32 activations are multiplied exactly (q is an integer) and summed in
# float32; bfloat16 activations and outputs round to 8 mantissa bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def quantized_weight(bits: int, group_size: int, symmetric: bool, n: int, k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=generator), bits, group_size, symmetric)


def on_device(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(
        weight.bits, weight.group_size, weight.q.to(DEVICE), weight.scales.to(DEVICE), weight.offsets.to(DEVICE)
    )


@pytest.mark.parametrize(
    "bits,group_size,symmetric,m,n,k,dtype",
    [
        (8, 32, True, 1, 64, 64, torch.float32),
        (8, 64, False, 5, 80, 128, torch.bfloat16),
        (4, 32, False, 1, 48, 96, torch.float32),
        (4, 128, True, 17, 64, 256, torch.bfloat16),
        (4, 64, False, 3, 130, 128, torch.float32),
    ],
)
def test_linear_matches_reference(bits, group_size, symmetric, m, n, k, dtype):
    """Ragged M (masked rows past 16), N not a multiple of the tile, every group size and both schemes."""
    weight = quantized_weight(bits, group_size, symmetric, n, k, seed=m * 7 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    packed = triton_weight_only.pack(on_device(weight))
    out = triton_weight_only.linear(x.to(DEVICE), packed, bias.to(DEVICE))
    assert out.dtype == dtype and out.shape == (m, n)
    expected = reference_linear(x, weight, bias)
    scale = expected.abs().max().item()
    error = (out.cpu().to(torch.float64) - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3g} against output scale {scale:.3g}"


def test_linear_without_bias_and_with_no_rows():
    weight = quantized_weight(4, 32, False, 64, 64, seed=3)
    packed = triton_weight_only.pack(on_device(weight))
    x = torch.randn(2, 64)
    out = triton_weight_only.linear(x.to(DEVICE), packed, None).cpu().to(torch.float64)
    torch.testing.assert_close(out, reference_linear(x, weight), atol=1e-4, rtol=1e-5)
    assert triton_weight_only.linear(x[:0].to(DEVICE), packed, None).shape == (0, 64)


def test_dequantize_is_the_formats():
    weight = quantized_weight(4, 64, True, 32, 128, seed=4)
    torch.testing.assert_close(
        triton_weight_only.dequantize(triton_weight_only.pack(on_device(weight)), torch.float32).cpu(),
        dequantize(weight),
    )


def test_bad_input_is_refused():
    packed = triton_weight_only.pack(on_device(quantized_weight(8, 32, True, 16, 64, seed=5)))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        triton_weight_only.linear(torch.randn(2, 32, device=DEVICE), packed, None)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_weight_only.linear(torch.randn(2, 64, device=DEVICE, dtype=torch.float64), packed, None)
