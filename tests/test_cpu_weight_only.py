"""The weight-only int8/int4 CPU kernel (kvkernels/cpu_weight_only.cpp) against the format's float64 reference
(kvkernels/weight_only.py) on random shapes, group sizes and schemes, in float32 and bfloat16; its layout read back
value by value; bad input refused. The portable torch backend is held to the same contract. tests/test_cpu_classes.py
reruns this file under every CPU class below this machine's (the AVX2 build on an AVX-512 machine)."""

import pytest
import torch

from kvkernels import cpu_weight_only, torch_weight_only, weight_only
from kvkernels.cpu_backend import cpu_flags

MISSING = cpu_weight_only.unsupported_reason()
needs_kernel = pytest.mark.skipif(MISSING is not None, reason=f"weight-only CPU kernel: {MISSING}")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert MISSING is not None or cpu_weight_only.load_kernel()


def random_weight(n: int, k: int, bits: int, group: int, symmetric: bool, seed: int) -> weight_only.QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05 + torch.rand(n, 1, generator=gen) * 0.02  # rows off centre
    return weight_only.quantize(w, bits, group, symmetric)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def assert_near_reference(out: torch.Tensor, expected: torch.Tensor, k: int, dtype: torch.dtype) -> None:
    """float32 accumulation over k products: error ~ sqrt(k) ulps of the products; bfloat16 out adds its rounding."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=scale * 2**-8)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=scale * 1e-6 * k**0.5)


def test_the_build_follows_the_cpu_flags():
    build = cpu_weight_only.kernel_build()
    flags = cpu_flags()
    if build is None:
        assert "avx2" not in flags or "fma" not in flags or "f16c" not in flags
        assert MISSING
    else:
        assert set(build.required) <= flags
        if build.isa == "avx2":  # the AVX-512 build is taken wherever its flags are
            assert not {"avx512f", "avx512bw", "avx512vl"} <= flags


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])  # each row-count specialisation and a mix of them
def test_linear_matches_the_reference(bits, group, symmetric, m):
    n, k = 48, 4 * group
    weight = random_weight(n, k, bits, group, symmetric, seed=bits * 1000 + group + m)
    x = activations(m, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    packed = cpu_weight_only.pack(weight)
    assert_near_reference(cpu_weight_only.linear(x, packed), weight_only.reference_linear(x, weight), k, x.dtype)
    out = cpu_weight_only.linear(x, packed, bias)
    assert_near_reference(out, weight_only.reference_linear(x, weight, bias), k, x.dtype)


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_bfloat16_activations_come_back_in_bfloat16(bits, m):
    n, k, group = 64, 576, 64
    weight = random_weight(n, k, bits, group, symmetric=False, seed=m)
    x = activations(m, k, seed=m).to(torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = cpu_weight_only.linear(x, cpu_weight_only.pack(weight), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_near_reference(out, weight_only.reference_linear(x.float(), weight, bias.float()), k, torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    bits = (8, 4)[seed % 2]
    group = (32, 64, 128)[seed % 3]
    n = 16 * int(torch.randint(1, 40, (1,), generator=gen))
    k = group * int(torch.randint(1, 13, (1,), generator=gen))
    m = int(torch.randint(1, 70, (1,), generator=gen))
    weight = random_weight(n, k, bits, group, symmetric=bool(seed % 4 < 2), seed=seed)
    x = activations(m, k, seed=seed)
    out = cpu_weight_only.linear(x, cpu_weight_only.pack(weight))
    assert_near_reference(out, weight_only.reference_linear(x, weight), k, x.dtype)


@needs_kernel
def test_no_rows_gives_an_empty_result():
    packed = cpu_weight_only.pack(random_weight(32, 64, 4, 32, True, seed=0))
    assert cpu_weight_only.linear(torch.empty(0, 64), packed).shape == (0, 32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 128])
def test_the_layout_reads_back_value_by_value(bits, group):
    weight = random_weight(64, 2 * group, bits, group, symmetric=False, seed=bits + group)
    packed = cpu_weight_only.pack(weight)
    exact = weight_only.dequantize(weight)
    assert torch.equal(cpu_weight_only.dequantize(packed), exact)
    assert torch.equal(cpu_weight_only.dequantize(packed, torch.bfloat16), exact.to(torch.bfloat16))
    rows = torch.tensor([63, 0, 17, 17, 31])
    assert torch.equal(cpu_weight_only.dequantize_rows(packed, rows), exact[rows])
    assert packed.nbytes() == 64 // 16 * (2 * group // group) * (64 + group * 16 * bits // 8)


def test_bad_input_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_weight_only.pack(random_weight(40, 64, 8, 32, True, seed=0))
    packed = cpu_weight_only.pack(random_weight(32, 64, 4, 32, True, seed=0))
    with pytest.raises(IndexError, match=r"rows must be in 0\.\.31"):
        cpu_weight_only.dequantize_rows(packed, torch.tensor([32]))
    if MISSING is None:
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            cpu_weight_only.linear(torch.zeros(1, 64, dtype=torch.float16), packed)
        with pytest.raises(RuntimeError, match="K = x.size"):
            cpu_weight_only.linear(torch.zeros(1, 96), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_keeps_the_same_contract(dtype):
    weight = random_weight(32, 128, 4, 64, symmetric=False, seed=1)
    x = activations(3, 128, seed=1).to(dtype)
    out = torch_weight_only.linear(x, torch_weight_only.pack(weight), None)
    assert out.dtype == dtype
    assert_near_reference(out, weight_only.reference_linear(x.float(), weight), 128, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_take_the_dequantized_gemm_chunk_by_chunk(dtype, monkeypatch):
    """dequantized_linear (steps of more than DEQUANTIZE_ABOVE_ROWS rows): the weight a chunk of panels at a time,
    here 3 panels a chunk over 5, with the bias sliced alike; equal to the GEMM on the whole dequantized weight."""
    weight = random_weight(80, 64, 4, 32, symmetric=False, seed=9)
    packed = cpu_weight_only.pack(weight)
    monkeypatch.setattr(
        cpu_weight_only, "DEQUANTIZE_CHUNK_BYTES", 3 * 16 * 64 * torch.empty(0, dtype=dtype).element_size()
    )
    x = torch.randn(40, 64).to(dtype)
    bias = torch.randn(80).to(dtype)
    whole = torch.nn.functional.linear(x, weight_only.dequantize(weight).to(dtype), bias)
    torch.testing.assert_close(cpu_weight_only.dequantized_linear(x, packed, bias), whole)
