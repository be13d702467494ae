"""FP8 (e4m3) in the Triton kernels: rounding, dequantising, and e4m3 held as bytes for GPUs without fp8.

Triton has e4m3 (tl.float8e4nv) only on sm_89 and newer. Elsewhere (an A100) the kernels receive an FP8 cache
viewed as uint8 and convert the bytes with integer arithmetic; a kernel tells the two apart by the cache
pointer's dtype, so one source serves both.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvkernels.attention import FP8_DTYPE


@functools.cache
def has_native_fp8(device: torch.device) -> bool:
    """Triton's e4m3 type works here: CUDA sm_89+, or the interpreter on the CPU."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: an FP8 cache becomes its bytes where Triton has no e4m3. A uint8 cache
    is taken to hold e4m3 bytes already."""
    if cache.dtype == FP8_DTYPE and not has_native_fp8(cache.device):
        return cache.view(torch.uint8)
    return cache


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in (FP8_DTYPE, torch.uint8)


@triton.jit
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still as float32, so that the cast
    which follows is exact. Rounding here rather than in the cast gives torch's bytes on the GPU and under
    TRITON_INTERPRET=1 alike: the interpreter's float->fp8 cast mis-rounds values that carry into the exponent."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    exponent = magnitude_bits >> 23  # biased by 127; e4m3 normals have exponent >= -6, i.e. >= 121 here
    # Normal range: keep 3 of the 23 mantissa bits, rounding half to even; a carry rolls into the exponent.
    keep_lsb = (magnitude_bits >> 20) & 1
    normal = ((magnitude_bits + 0x7FFFF + keep_lsb) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal range: the value is m * 2^-9 with integer m in [0, 8]; round the significand to that grid.
    significand = (magnitude_bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exponent, 31)
    quotient = significand >> shift
    remainder = significand - (quotient << shift)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = (quotient + round_up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)
    magnitude = tl.where(exponent >= 121, normal, subnormal)
    return tl.where(bits < 0, -magnitude, magnitude)


@triton.jit
def e4m3_to_bytes(x):
    """x: float32 values that are exactly e4m3 values (see round_to_e4m3) -> their e4m3 bytes as uint8."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    exponent = magnitude_bits >> 23
    normal = ((exponent - 120) << 3) | ((magnitude_bits >> 20) & 0x7)
    subnormal = (tl.abs(x) * 512.0).to(tl.int32)
    byte = tl.where(exponent >= 121, normal, subnormal) | tl.where(bits < 0, 0x80, 0)
    return byte.to(tl.uint8)


@triton.jit
def e4m3_from_bytes(byte):
    """uint8 e4m3 bytes -> float32 (exact)."""
    byte = byte.to(tl.int32)
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * (1.0 / 512.0)
    magnitude = tl.where(exponent > 0, normal, subnormal)
    return tl.where((byte & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def dequantize(x, scale):
    """Values loaded from a cache: e4m3 (native or as bytes) become float32 times scale; others pass as they are."""
    if x.dtype == tl.uint8:
        x = e4m3_from_bytes(x) * scale
    elif x.dtype == tl.float8e4nv:
        x = x.to(tl.float32) * scale
    return x
