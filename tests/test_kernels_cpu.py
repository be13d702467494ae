"""The AVX-512 BF16 attention kernel (kernels/cpu_attention.cpp) against the plain reference, the backend's
choice of path, and the CPU-side speed-ups of the model runner (packed bf16 linears, kept heap)."""

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu_backend as cpu_backend
from kernels.attention import FP8_DTYPE
from kernels.cpu_backend import CpuAttentionBackend, unsupported_reason
from kernels.reference import make_paged_batch, reference_attend, reference_write_kv
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.cpu_memory import keep_freed_memory
from worker.engine import LLMEngine
from worker.model.packed_linear import PackedLinear, pack_linears, packing_supported

needs_kernel = pytest.mark.skipif(unsupported_reason() is not None, reason=f"{unsupported_reason()}")

# bf16 inputs, P rounded to bf16 before P.V: the error is that of bf16 itself.
ATOL, RTOL = 2e-2, 2e-2

# A mixed step: a fresh prefill, decodes, an extend whose prefix ends mid-block, a chunk whose prefix ends on
# a block boundary, a one-token prefill and a decode over a long context.
MIXED = ([5, 1, 7, 1, 16, 1, 1], [5, 9, 20, 33, 48, 1, 70])


def written_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, seed=0):
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, cache_dtype, seed=seed
    )
    reference_write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping, *scales(batch))
    return batch


def scales(batch) -> tuple[float, float]:
    return batch.k_scale, batch.v_scale


def run_kernel(batch) -> torch.Tensor:
    """The backend, asserting that it takes the kernel's path."""
    backend = CpuAttentionBackend()
    assert backend.runs_kernel(batch.q, batch.k_cache)
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.q.shape[-1] ** -0.5, *scales(batch))
    return backend.attend(batch.q, *args)


def reference(batch) -> torch.Tensor:
    args = (batch.k_cache, batch.v_cache, batch.meta, batch.q.shape[-1] ** -0.5, *scales(batch))
    return reference_attend(batch.q, *args)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [16, 8, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_kernel_matches_reference_on_mixed_step(group, head_dim, block_size, cache_dtype):
    batch = written_batch(*MIXED, 2 * group, 2, head_dim, block_size, cache_dtype, seed=group)
    torch.testing.assert_close(run_kernel(batch), reference(batch), atol=ATOL, rtol=RTOL)


@needs_kernel
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([130], [130]),  # a prefill over several query tiles (16) and key tiles (64), ending mid-tile
        ([70], [200]),  # an extend whose prefix ends mid key tile
        ([33, 1], [97, 65]),  # an extend and a decode
        ([1, 1, 1], [3, 300, 64]),  # decodes only, one exactly a key tile long
        ([64], [128]),  # everything on tile boundaries
    ],
)
def test_kernel_tiles_and_boundaries(query_lens, seq_lens):
    batch = written_batch(query_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, seed=len(query_lens))
    torch.testing.assert_close(run_kernel(batch), reference(batch), atol=ATOL, rtol=RTOL)


@needs_kernel
def test_kernel_is_finite_over_a_cache_full_of_nan():
    """Keys past a sequence's end are masked; stale NaN in the rest of its last block must not leak in."""
    batch = written_batch([5, 3], [21, 3], 4, 2, 64, 16, torch.bfloat16)
    for cache in (batch.k_cache, batch.v_cache):
        for i, seq_len in enumerate(batch.meta.seq_lens_cpu):
            last_block = batch.meta.block_tables[i, (seq_len - 1) // 16]
            cache[last_block, seq_len % 16 or 16 :] = float("nan")
    torch.testing.assert_close(run_kernel(batch), reference(batch), atol=ATOL, rtol=RTOL)


@needs_kernel
def test_backend_runs_the_kernel_for_bf16_only():
    backend = CpuAttentionBackend()
    bf16 = written_batch(*MIXED, 6, 2, 64, 16, torch.bfloat16)
    assert backend.runs_kernel(bf16.q, bf16.k_cache)
    assert not backend.runs_kernel(bf16.q.float(), bf16.k_cache.float())  # float32 models keep SDPA
    assert not backend.runs_kernel(bf16.q[..., :48], bf16.k_cache)  # head sizes the kernel was not built for


def test_backend_falls_back_to_torch_when_the_kernel_is_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_backend, "load_kernel", lambda: False)
    batch = written_batch(*MIXED, 6, 2, 64, 16, torch.bfloat16)
    backend = CpuAttentionBackend()
    assert not backend.runs_kernel(batch.q, batch.k_cache)
    out = backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 64**-0.5)
    torch.testing.assert_close(out, reference(batch), atol=ATOL, rtol=RTOL)


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


@pytest.mark.skipif(not packing_supported(), reason="oneDNN cannot run bf16 here")
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


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_keep_freed_memory_on_linux():
    assert keep_freed_memory()
