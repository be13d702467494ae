"""The CPU attention backend against the plain reference on the path this machine runs (the AVX-512 BF16 kernel
in kvkernels/cpu_attention.cpp for bf16 models where the CPU has it; the torch path for the float32 models that
`--dtype auto` picks elsewhere), the backend's choice of path, and the CPU-side speed-ups of the model runner
(packed linears, bf16 decode weights, kept heap). A test that needs a CPU feature this one lacks skips with the
feature's name in its reason (`pytest -rs` lists them)."""

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvkernels.cpu_backend as cpu_backend
import worker.model.packed_linear as packed_linear
from kvkernels import cpu_linear
from kvkernels.attention import FP8_DTYPE
from kvkernels.cpu_backend import HIDE_FLAGS_ENV, CpuAttentionBackend, unsupported_reason
from kvkernels.reference import make_paged_batch, reference_attend, reference_write_kv
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_memory import keep_freed_memory
from worker.engine import LLMEngine
from worker.model.packed_linear import (
    DECODE_ROWS,
    Bf16DecodeLinear,
    PackedLinear,
    add_bf16_decode_weights,
    pack_linears,
    packing_supported,
)
from worker.model_runner import uses_bf16_decode_weights

KERNEL_MISSING = unsupported_reason()
needs_kernel = pytest.mark.skipif(KERNEL_MISSING is not None, reason=f"AVX-512 BF16 kernel: {KERNEL_MISSING}")
needs_linear_kernel = pytest.mark.skipif(
    cpu_linear.unsupported_reason() is not None, reason=f"AVX2 bf16 linear kernel: {cpu_linear.unsupported_reason()}"
)
# The dtype whose attention path this machine's `auto` models run: bf16 on the kernel, else float32 (torch path).
MACHINE_DTYPE = torch.bfloat16 if KERNEL_MISSING is None else torch.float32
# bf16 inputs, P rounded to bf16 before P.V: the error is that of bf16 itself. float32: summation order only.
TOLERANCES = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}

# A mixed step: a fresh prefill, decodes, an extend whose prefix ends mid-block, a chunk whose prefix ends on
# a block boundary, a one-token prefill and a decode over a long context.
MIXED = ([5, 1, 7, 1, 16, 1, 1], [5, 9, 20, 33, 48, 1, 70])
# Steps that cross the kernels' query tiles (16) and key tiles (64), or end on their boundaries.
TILE_CASES = [
    ([130], [130]),  # a prefill over several query tiles (16) and key tiles (64), ending mid-tile
    ([70], [200]),  # an extend whose prefix ends mid key tile
    ([33, 1], [97, 65]),  # an extend and a decode
    ([1, 1, 1], [3, 300, 64]),  # decodes only, one exactly a key tile long
    ([64], [128]),  # everything on tile boundaries
]


def written_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, cache_dtype=None, seed=0, dtype=MACHINE_DTYPE
):
    """A random paged batch in `dtype` with its K/V written; cache_dtype None is the model's dtype."""
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed=seed
    )
    reference_write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping, *scales(batch))
    return batch


def scales(batch) -> tuple[float, float]:
    return batch.k_scale, batch.v_scale


def run_backend(batch) -> torch.Tensor:
    """The CPU backend, asserting that it takes this machine's path for the batch: the kernel for bf16 where the
    CPU has it, the torch path otherwise."""
    backend = CpuAttentionBackend()
    assert backend.runs_kernel(batch.q, batch.k_cache) == (batch.q.dtype == torch.bfloat16 and KERNEL_MISSING is None)
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.q.shape[-1] ** -0.5, *scales(batch))
    return backend.attend(batch.q, *args)


def reference(batch) -> torch.Tensor:
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.q.shape[-1] ** -0.5, *scales(batch))
    return reference_attend(batch.q, *args)


def assert_matches_reference(batch) -> None:
    torch.testing.assert_close(run_backend(batch), reference(batch), **TOLERANCES[batch.q.dtype])


@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("block_size", [16, 8, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_backend_matches_reference_on_mixed_step(group, head_dim, block_size, cache_dtype):
    batch = written_batch(*MIXED, 2 * group, 2, head_dim, block_size, cache_dtype, seed=group)
    assert_matches_reference(batch)


@pytest.mark.parametrize("query_lens, seq_lens", TILE_CASES)
def test_backend_tiles_and_boundaries(query_lens, seq_lens):
    assert_matches_reference(written_batch(query_lens, seq_lens, 9, 3, 64, 16, seed=len(query_lens)))


def test_backend_is_finite_over_a_cache_full_of_nan():
    """Keys past a sequence's end are masked; stale NaN in the rest of its last block must not leak in."""
    batch = written_batch([5, 3], [21, 3], 4, 2, 64, 16)
    for cache in (batch.k_cache, batch.v_cache):
        for i, seq_len in enumerate(batch.meta.seq_lens_cpu):
            last_block = batch.meta.block_tables[i, (seq_len - 1) // 16]
            cache[last_block, seq_len % 16 or 16 :] = float("nan")
    assert_matches_reference(batch)


def test_backend_picks_the_kernel_for_bf16_only_where_the_cpu_has_it():
    backend = CpuAttentionBackend()
    bf16 = written_batch(*MIXED, 6, 2, 64, 16, dtype=torch.bfloat16)
    assert backend.runs_kernel(bf16.q, bf16.k_cache) == (KERNEL_MISSING is None)
    assert not backend.runs_kernel(bf16.q.float(), bf16.k_cache.float())  # float32 models keep SDPA
    assert not backend.runs_kernel(bf16.q[..., :48], bf16.k_cache)  # head sizes the kernel was not built for
    if KERNEL_MISSING is not None:
        assert backend.describe(torch.bfloat16, 64) == f"cpu: torch path ({KERNEL_MISSING})"


def test_backend_falls_back_to_torch_when_the_kernel_is_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_backend, "load_kernel", lambda: False)
    batch = written_batch(*MIXED, 6, 2, 64, 16, dtype=torch.bfloat16)
    backend = CpuAttentionBackend()
    assert not backend.runs_kernel(batch.q, batch.k_cache)
    out = backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 64**-0.5)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.bfloat16])


def test_unsupported_reason_names_the_missing_flags(monkeypatch):
    monkeypatch.setattr(cpu_backend, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    monkeypatch.setattr(cpu_backend.platform, "machine", lambda: "x86_64")
    assert unsupported_reason() == "the CPU lacks avx512vl, avx512_bf16"


@needs_kernel
def test_bf16_engine_with_the_kernel_agrees_with_the_torch_path():
    """A prefill and an extend over a cached prefix of the tiny model in bf16, teacher-forced: the kernel's
    logits against the torch path's (bf16 both, so they differ by bf16 rounding, not by more)."""
    prompt = [(7 * j + 3) % 49152 for j in range(130)]
    logits = {}
    for backend in ("cpu", "torch"):
        engine = LLMEngine(EngineConfig(model="tiny", dtype="bfloat16", attention_backend=backend, num_kv_blocks=64))
        assert engine.runner.backend.name == backend
        engine.generate([prompt[:96]], [SamplingParams(max_tokens=1, temperature=0.0)])  # caches 96 tokens
        extend = engine.prompt_logits(prompt)
        assert extend.shape[0] == 130 - 96
        logits[backend] = torch.cat([engine.prompt_logits(prompt, cache_salt="uncached"), extend])
    scale = logits["torch"].abs().max().item()
    assert (logits["cpu"] - logits["torch"]).abs().max().item() < 0.05 * scale
    assert (logits["cpu"].argmax(-1) == logits["torch"].argmax(-1)).float().mean().item() >= 0.95


def bad_fp8_tables(dtype: torch.dtype) -> list[tuple[torch.Tensor, str]]:
    """FP8 tables a kernel must refuse, each with what its error says."""
    return [
        (torch.zeros(256, dtype=torch.float16), "got Half"),
        (torch.zeros(128, dtype=dtype), "got .* \\[128\\]"),
        (torch.zeros(16, 16, dtype=dtype), "got .* \\[16, 16\\]"),
        (torch.zeros(512, dtype=dtype)[::2], "not contiguous"),
    ]


def assert_refuses_bad_fp8_tables(op, dtype: torch.dtype) -> None:
    batch = written_batch([3, 1], [3, 20], 4, 2, 64, 16, FP8_DTYPE, dtype=dtype)
    backend, meta = CpuAttentionBackend(), batch.meta
    good = backend.fp8_lut(batch.k_scale, dtype)
    for bad, message in bad_fp8_tables(dtype):
        for k_lut, v_lut, name in ((bad, good, "k_lut"), (good, bad, "v_lut")):
            args = (batch.k_cache.view(torch.uint8), batch.v_cache.view(torch.uint8), meta.block_tables)
            with pytest.raises(
                RuntimeError, match=f"{name} must be a contiguous .* CPU tensor of 256 entries .*{message}"
            ):
                op(batch.q, *args, meta.query_start_loc, meta.seq_lens, 0.125, k_lut, v_lut, torch.empty_like(batch.q))


@needs_kernel
def test_bf16_kernel_refuses_an_fp8_table_that_is_not_256_contiguous_bf16_entries():
    assert cpu_backend.load_kernel()
    assert_refuses_bad_fp8_tables(torch.ops.kvroute_cpu.paged_attention, torch.bfloat16)


@pytest.mark.skipif(not packing_supported(), reason=f"oneDNN packing: {cpu_backend.native_bf16()[1]}")
def test_packed_linear_matches_f_linear_and_packs_bf16_and_fp32_cpu_linears():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        linear = nn.Linear(96, 160, bias=True).to(dtype)
        packed = PackedLinear(linear)
        for rows in (1, 7, 300):
            x = torch.randn(rows, 96, dtype=dtype)
            if dtype == torch.bfloat16:  # oneDNN either way: the same kernels, bit for bit
                assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
            else:  # MKL against oneDNN: float32 both, summed in another order
                torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8).double())
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], nn.Linear)


def test_nothing_is_packed_when_the_hide_switch_hides_native_bf16(monkeypatch):
    monkeypatch.setenv(HIDE_FLAGS_ENV, "avx512_bf16,amx_bf16,bf16")
    assert not packing_supported()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 0


@needs_linear_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 65])
def test_bf16_linear_kernel_equals_float32_on_the_rounded_weight(rows, bias):
    """Every micro-kernel height (1-4 rows, and groups of 4 plus a remainder) against float32 products of the
    bf16-rounded weight, over 3 panels of 16 features and a K that is no multiple of 8."""
    assert cpu_linear.load_kernel()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 75, generator=gen)
    x = torch.randn(rows, 75, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    expected = F.linear(x, weight.bfloat16().float(), b)
    out = cpu_linear.bf16_linear(x, cpu_linear.pack_weight(weight), b)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_linear_kernel
def test_bf16_decode_linear_reads_the_copy_up_to_decode_rows_only():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    decode = Bf16DecodeLinear(linear)
    assert decode.weight is linear.weight  # a tied lm_head stays tied
    small = torch.randn(DECODE_ROWS, 64)  # float32 products of the bf16-rounded weight
    torch.testing.assert_close(decode(small), F.linear(small, linear.weight.bfloat16().float(), linear.bias))
    large = torch.randn(DECODE_ROWS + 1, 64)
    assert torch.equal(decode(large), F.linear(large, linear.weight, linear.bias))
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 40), nn.Linear(64, 32).to(torch.bfloat16))
    assert add_bf16_decode_weights(model) == 1  # 40 outputs are not whole panels of 16; bf16 runs natively
    assert isinstance(model[0], Bf16DecodeLinear)


def test_bf16_decode_weights_only_for_auto_float32_without_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_backend, "_proc_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(cpu_backend.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(HIDE_FLAGS_ENV, raising=False)
    auto = EngineConfig(model="smollm2")
    assert uses_bf16_decode_weights(auto, torch.float32)
    assert not uses_bf16_decode_weights(EngineConfig(model="smollm2", dtype="float32"), torch.float32)
    assert not uses_bf16_decode_weights(EngineConfig(model="tiny"), torch.float32)
    monkeypatch.setattr(cpu_backend, "_proc_cpu_flags", lambda: frozenset({"avx2"}))  # no FMA: no kernel
    assert packed_linear.bf16_decode_weights_supported() == "the CPU lacks fma"
    assert not uses_bf16_decode_weights(auto, torch.float32)
    monkeypatch.setattr(cpu_backend, "_proc_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_bf16"}))
    assert packed_linear.bf16_decode_weights_supported() == "the CPU multiplies bf16 natively"


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_keep_freed_memory_on_linux():
    assert keep_freed_memory()


# ---- the AVX2 float32 kernel (kvkernels/cpu_attention_fp32.cpp) ----------------------------------------------------

FP32_KERNEL_MISSING = cpu_backend.fp32_unsupported_reason()
needs_fp32_kernel = pytest.mark.skipif(
    FP32_KERNEL_MISSING is not None, reason=f"AVX2 float32 kernel: {FP32_KERNEL_MISSING}"
)


def run_fp32_kernel(batch) -> torch.Tensor:
    """The float32 kernel itself, whichever path the backend would pick on this CPU."""
    assert cpu_backend.load_fp32_kernel()
    op = torch.ops.kvroute_cpu_fp32.paged_attention
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.q.shape[-1] ** -0.5, batch.k_scale, batch.v_scale)
    return CpuAttentionBackend().call_kernel(op, batch.q, *args)


def assert_fp32_kernel_matches_reference(batch) -> None:
    torch.testing.assert_close(run_fp32_kernel(batch), reference(batch), **TOLERANCES[torch.float32])


@needs_fp32_kernel
@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["float32", "fp8"])
@pytest.mark.parametrize("block_size", [16, 8, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_fp32_kernel_matches_reference_on_mixed_step(group, head_dim, block_size, cache_dtype):
    batch = written_batch(*MIXED, 2 * group, 2, head_dim, block_size, cache_dtype, seed=group, dtype=torch.float32)
    assert_fp32_kernel_matches_reference(batch)


@needs_fp32_kernel
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [*TILE_CASES, ([3, 2, 1], [131, 66, 1])],  # and tiles that end short of a whole 4-key step
)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_fp32_kernel_tiles_and_boundaries(query_lens, seq_lens, group):
    batch = written_batch(query_lens, seq_lens, 3 * group, 3, 64, 16, seed=len(query_lens), dtype=torch.float32)
    assert_fp32_kernel_matches_reference(batch)


@needs_fp32_kernel
@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["float32", "fp8"])
def test_fp32_kernel_is_finite_over_a_cache_full_of_nan(cache_dtype):
    """The partial last block of each sequence holds NaN past seq_len: the kernel must never read it."""
    batch = written_batch([5, 3, 1], [21, 3, 40], 6, 2, 64, 16, cache_dtype, dtype=torch.float32)
    for cache in (batch.k_cache, batch.v_cache):
        raw = cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache
        nan = 0x7F if cache.dtype == FP8_DTYPE else float("nan")  # 0x7f is e4m3's NaN
        for i, seq_len in enumerate(batch.meta.seq_lens_cpu):
            last_block = batch.meta.block_tables[i, (seq_len - 1) // 16]
            raw[last_block, seq_len % 16 or 16 :] = nan
    out = run_fp32_kernel(batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


@needs_fp32_kernel
def test_fp32_kernel_refuses_an_fp8_table_that_is_not_256_contiguous_float32_entries():
    assert cpu_backend.load_fp32_kernel()
    assert_refuses_bad_fp8_tables(torch.ops.kvroute_cpu_fp32.paged_attention, torch.float32)


@needs_fp32_kernel
def test_fp32_kernel_softmax_survives_large_and_underflowing_scores():
    """Scores 100x the usual spread: most probabilities underflow, and the running max moves by a lot."""
    batch = written_batch([40, 1], [150, 90], 6, 2, 64, 8, seed=3, dtype=torch.float32)
    batch.q.mul_(100.0)
    assert_fp32_kernel_matches_reference(batch)


def avx2_only_cpu(monkeypatch, flags=frozenset({"avx2", "fma"})) -> None:
    monkeypatch.setattr(cpu_backend, "_proc_cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_backend.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(HIDE_FLAGS_ENV, raising=False)


@needs_fp32_kernel
def test_float32_models_take_the_fp32_kernel_on_avx2_cpus_without_avx512(monkeypatch):
    avx2_only_cpu(monkeypatch)
    backend = CpuAttentionBackend()
    batch = written_batch(*MIXED, 9, 3, 64, 16, dtype=torch.float32)
    assert backend.runs_fp32_kernel(batch.q, batch.k_cache)
    assert not backend.runs_kernel(batch.q, batch.k_cache)
    assert not backend.runs_fp32_kernel(batch.q[..., :48], batch.k_cache)  # head sizes it was not built for
    assert backend.describe(torch.float32, 64) == "cpu: C++ AVX2 float32 paged attention kernel"
    assert (
        backend.describe(torch.bfloat16, 64)
        == "cpu: torch path (the CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16)"
    )
    out = backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 64**-0.5)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    "machine, flags, reason",
    [
        ("x86_64", {"avx2", "fma", "avx512f"}, "SDPA's AVX-512 code is faster than the AVX2 kernel"),
        ("x86_64", {"avx2"}, "the CPU lacks fma"),
        ("aarch64", {"asimd"}, "the CPU is aarch64, not x86_64"),
    ],
)
def test_float32_models_keep_the_torch_path_elsewhere(monkeypatch, machine, flags, reason):
    avx2_only_cpu(monkeypatch, frozenset(flags))
    monkeypatch.setattr(cpu_backend.platform, "machine", lambda: machine)
    backend = CpuAttentionBackend()
    batch = written_batch(*MIXED, 6, 2, 64, 16, dtype=torch.float32)
    assert not backend.runs_fp32_kernel(batch.q, batch.k_cache)
    assert backend.describe(torch.float32, 64) == f"cpu: torch path (a float32 model; {reason})"
    assert_matches_reference(batch)


def test_float32_models_fall_back_to_torch_when_the_fp32_kernel_does_not_build(monkeypatch):
    avx2_only_cpu(monkeypatch)
    monkeypatch.setattr(cpu_backend, "load_fp32_kernel", lambda: False)
    backend = CpuAttentionBackend()
    batch = written_batch(*MIXED, 6, 2, 64, 16, dtype=torch.float32)
    assert not backend.runs_fp32_kernel(batch.q, batch.k_cache)
    assert (
        backend.describe(torch.float32, 64) == "cpu: torch path (the C++ float32 kernel did not build; see the warning)"
    )
    out = backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 64**-0.5)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])
