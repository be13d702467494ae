"""The Triton kernels against the plain reference, run on the CPU by Triton's interpreter.

TRITON_INTERPRET must be set before the kernel modules are imported (triton.jit reads it when it decorates),
so it is set here, before those imports. The interpreter is slow: shapes are tiny and cases are chosen to
cover block sizes 16 and 8, head dims 64 and 128, GQA ratios 1, 3 and 8, ragged batches, prefixes ending
mid-block, contexts crossing split-KV partitions, and FP8 (native and as bytes) / 16-bit / 32-bit caches, not
their full product.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvkernels.attention import FP8_DTYPE  # noqa: E402
from kvkernels.backend_select import get_attention_backend  # noqa: E402
from kvkernels.reference import make_paged_batch, reference_attend, reference_write_kv  # noqa: E402
from kvkernels.torch_attention import TorchAttentionBackend  # noqa: E402
from kvkernels.triton_backend import TritonAttentionBackend  # noqa: E402
from kvkernels.triton_cache_write import write_kv  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

# Query dtype -> (atol, rtol). FP8 caches are compared on the same stored values, so the tolerance is that of
# the compute dtype. bfloat16 outputs round to 8 mantissa bits (about 4e-3 relative); on the GPU the kernel's
# bfloat16 dots add some more.
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}

# Each case: (block_size, head_dim, group, dtype, cache dtype).
CASES = [
    (16, 64, 1, torch.float32, torch.float32),
    (16, 128, 3, torch.bfloat16, torch.bfloat16),
    (8, 64, 8, torch.float32, FP8_DTYPE),
    (8, 128, 1, torch.bfloat16, FP8_DTYPE),
    (16, 64, 3, torch.float32, FP8_DTYPE),
    (8, 64, 3, torch.bfloat16, torch.bfloat16),
]


def case_id(case: tuple) -> str:
    block_size, head_dim, group, dtype, cache_dtype = case
    return f"bs{block_size}-d{head_dim}-g{group}-{dtype}-{cache_dtype}".replace("torch.", "")


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def check_attention(
    backend, query_lens: list[int], seq_lens: list[int], case: tuple, seed: int = 0, fp8_as_bytes: bool = False
) -> None:
    """fp8_as_bytes: hand the kernels the FP8 cache as uint8, as on GPUs without e4m3 (sm_80)."""
    block_size, head_dim, group, dtype, cache_dtype = case
    batch = make_paged_batch(query_lens, seq_lens, 2 * group, 2, head_dim, block_size, dtype, cache_dtype, DEVICE, seed)
    scales = (batch.k_scale, batch.v_scale)
    reference_write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping, *scales)
    args = (batch.meta, head_dim**-0.5, *scales)
    caches = (batch.k_cache, batch.v_cache)
    kernel_caches = tuple(c.view(torch.uint8) for c in caches) if fp8_as_bytes else caches
    out = backend.attend(batch.q, *kernel_caches, *args)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, reference_attend(batch.q, *caches, *args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_kind", ["same", "fp8", "fp8-as-bytes"])
def test_write_kv_matches_reference_bit_for_bit(dtype, cache_kind):
    cache_dtype = dtype if cache_kind == "same" else FP8_DTYPE
    batch = make_paged_batch([6], [6], 2, 2, 64, 8, dtype, cache_dtype, DEVICE)
    # Wide magnitudes (FP8 subnormals to saturation) and, for FP8, values exactly halfway between e4m3 values.
    k = batch.k * torch.logspace(-4, 3, 6, device=DEVICE).to(dtype)[:, None, None]
    e4m3_values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    e4m3_values = e4m3_values[~e4m3_values.isnan()].unique().to(DEVICE)
    halfway = (e4m3_values[1:] + e4m3_values[:-1]) / 2 * batch.k_scale
    k.view(-1)[: halfway.numel()] = halfway.to(dtype)
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    reference_write_kv(k, batch.v, k_ref, v_ref, slots, batch.k_scale, batch.v_scale)
    caches = (batch.k_cache, batch.v_cache)
    kernel_caches = tuple(c.view(torch.uint8) for c in caches) if cache_kind == "fp8-as-bytes" else caches
    write_kv(k, batch.v, *kernel_caches, slots, batch.k_scale, batch.v_scale)
    assert torch.equal(cache_bytes(batch.k_cache), cache_bytes(k_ref))
    assert torch.equal(cache_bytes(batch.v_cache), cache_bytes(v_ref))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_kernel_ragged_contexts_across_partitions(case):
    # Partitions of 32 tokens: contexts of 1 to 3 partitions, one ending exactly on a partition boundary.
    check_attention(TritonAttentionBackend(partition_size=32), [1, 1, 1, 1], [3, 32, 47, 70], case)


def test_decode_kernel_combines_more_partitions_than_one_chunk():
    # 40 partitions of 16 tokens: the combine kernel folds them in chunks of 32.
    check_attention(TritonAttentionBackend(partition_size=16), [1, 1], [640, 17], CASES[4])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_kernel_fresh_extend_and_chunks(case):
    # A fresh prefill, an extend over a prefix ending mid-block, a chunk after a block-aligned prefix, and one
    # longer than a query tile (64 rows) over a prefix longer than a key tile.
    check_attention(TritonAttentionBackend(), [5, 7, 16, 70], [5, 20, 48, 150], case)


@pytest.mark.parametrize("case", CASES[:2], ids=case_id)
def test_backend_mixed_step_uses_both_kernels(case):
    check_attention(TritonAttentionBackend(partition_size=16), [1, 9, 1, 3, 1], [40, 9, 5, 19, 17], case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_as_bytes(dtype):
    case = (16, 64, 3, dtype, FP8_DTYPE)
    check_attention(TritonAttentionBackend(partition_size=16), [1, 9, 1], [40, 12, 7], case, fp8_as_bytes=True)


def test_triton_backend_agrees_with_torch_backend():
    batch = make_paged_batch([1, 6, 1], [33, 6, 12], 6, 2, 64, 16, device=DEVICE, seed=3)
    torch_backend, triton_backend = TorchAttentionBackend(), get_attention_backend("triton", DEVICE)
    assert triton_backend.name == "triton"
    triton_backend.write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    args = (batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(triton_backend.attend(batch.q, *args), torch_backend.attend(batch.q, *args))
