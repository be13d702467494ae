"""The fast torch attention path against the plain reference, and the metadata builder."""

import pytest
import torch

from kvkernels.attention import FP8_DTYPE, AttentionMetadata
from kvkernels.backend_select import get_attention_backend
from kvkernels.reference import make_paged_batch, reference_attend, reference_write_kv
from kvkernels.torch_attention import TorchAttentionBackend

# (query dtype, cache dtype) -> (atol, rtol). FP8 caches are compared on the same stored values, so their
# tolerance is that of the compute dtype; bfloat16 SDPA rounds its output to 8 mantissa bits.
DTYPES = {
    (torch.float32, torch.float32): (2e-5, 1e-4),
    (torch.bfloat16, torch.bfloat16): (2e-2, 2e-2),
    (torch.float32, FP8_DTYPE): (2e-5, 1e-4),
    (torch.bfloat16, FP8_DTYPE): (2e-2, 2e-2),
}

# A mixed step: a fresh prefill, decodes, an extend whose prefix ends mid-block, a chunk whose prefix ends on a
# block boundary, a one-token prefill and a decode over a long context.
MIXED_QUERY_LENS = [5, 1, 7, 1, 16, 1, 1]
MIXED_SEQ_LENS = [5, 9, 20, 33, 48, 1, 70]


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def run_both(batch, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K/V with the backend under test and with the reference, check the caches agree, and
    return (backend output, reference output)."""
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    reference_write_kv(batch.k, batch.v, k_ref, v_ref, batch.meta.slot_mapping, batch.k_scale, batch.v_scale)
    scales = (batch.k_scale, batch.v_scale)
    backend.write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping, *scales)
    assert torch.equal(cache_bytes(batch.k_cache), cache_bytes(k_ref))
    assert torch.equal(cache_bytes(batch.v_cache), cache_bytes(v_ref))
    scale = batch.q.shape[-1] ** -0.5
    args = (batch.k_cache, batch.v_cache, batch.meta, scale, batch.k_scale, batch.v_scale)
    return backend.attend(batch.q, *args), reference_attend(batch.q, *args)


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_torch_attention_matches_reference_on_mixed_step(block_size, head_dim, group, dtypes):
    dtype, cache_dtype = dtypes
    batch = make_paged_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, 2 * group, 2, head_dim, block_size, dtype, cache_dtype, seed=group
    )
    out, ref = run_both(batch, TorchAttentionBackend())
    assert out.dtype == dtype and out.shape == batch.q.shape
    atol, rtol = DTYPES[dtypes]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1, 1, 1, 1], [3, 17, 16, 40]),  # decode-only, ragged
        ([1, 1, 1], [21, 21, 21]),  # decode-only, equal contexts ending mid-block: no mask
        ([12], [12]),  # one fresh prefill
        ([4, 9], [30, 9]),  # extend then prefill
        ([1, 6, 1], [25, 6, 2]),  # decodes around a prefill: rows are scattered
    ],
)
def test_torch_attention_batch_shapes(query_lens, seq_lens):
    batch = make_paged_batch(query_lens, seq_lens, 6, 2, 64, 16)
    out, ref = run_both(batch, TorchAttentionBackend())
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_write_kv_skips_slot_minus_one():
    batch = make_paged_batch([4], [4], 2, 2, 64, 8)
    before = batch.k_cache.clone()
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    TorchAttentionBackend().write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, slots)
    flat, flat_before = batch.k_cache.view(-1, 2, 64), before.view(-1, 2, 64)
    assert torch.equal(flat[batch.meta.slot_mapping[1]], flat_before[batch.meta.slot_mapping[1]])
    assert torch.equal(flat[slots[[0, 2, 3]]], batch.k[[0, 2, 3]])


def test_fp8_write_quantises_with_scale_and_saturates():
    k_cache = torch.zeros(1, 4, 1, 2, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.tensor([[[1.0, -2.0]], [[1000.0, -1000.0]]])
    TorchAttentionBackend().write_kv(k, k, k_cache, v_cache, torch.tensor([0, 3]), k_scale=0.5, v_scale=4.0)
    assert k_cache[0, 0, 0].float().tolist() == [2.0, -4.0]
    assert k_cache[0, 3, 0].float().tolist() == [448.0, -448.0]
    assert v_cache[0, 0, 0].float().tolist() == [0.25, -0.5]


def test_metadata_build_slots_and_offsets():
    meta = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len) == (2, 5)
    assert (meta.query_lens_cpu, meta.seq_lens_cpu) == ([2, 1], [5, 3])


@pytest.mark.parametrize(
    "query_lens, seq_lens, tables, message",
    [
        ([3], [2], [[0]], "query_len 3"),
        ([0], [2], [[0]], "query_len 0"),
        ([1], [9], [[0, 1]], "cannot hold seq_len 9"),
        ([1, 1], [1], [[0]], "differ in length"),
        ([], [], [], "empty"),
    ],
)
def test_metadata_build_rejects_bad_batches(query_lens, seq_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, block_size=4)


def test_get_attention_backend():
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_attention_backend("cpu", "meta")
    with pytest.raises(ValueError, match="must be one of"):
        get_attention_backend("flash", "cpu")
