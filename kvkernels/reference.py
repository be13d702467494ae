"""Plain, obviously-correct paged attention (a loop over tokens and heads, explicit softmax in float32), used
only by tests to check the fast torch path and the Triton kernels; and random paged batches to test and
benchmark them with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkernels.attention import FP8_DTYPE, AttentionMetadata, from_cache_dtype, to_cache_dtype


def reference_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = to_cache_dtype(k[t], k_cache.dtype, k_scale)
        v_cache[block, offset] = to_cache_dtype(v[t], v_cache.dtype, v_scale)


def reference_attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i].tolist()
        blocks = [table[p // block_size] for p in range(seq_len)]
        offsets = [p % block_size for p in range(seq_len)]
        k = from_cache_dtype(k_cache[blocks, offsets], torch.float32, k_scale)  # [seq_len, Hkv, D]
        v = from_cache_dtype(v_cache[blocks, offsets], torch.float32, v_scale)
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            t = starts[i] + j
            visible = seq_len - q_len + j + 1  # causal: keys at positions <= this token's position
            for h in range(num_heads):
                scores = (k[:visible, h // group] @ q[t, h].float()) * softmax_scale
                probs = torch.softmax(scores, dim=0)
                out[t, h] = (probs @ v[:visible, h // group]).to(q.dtype)
    return out


@dataclass
class PagedBatch:
    """A random step for tests and benchmarks: a cache whose cached prefixes hold random K/V, and the step's
    new tokens (q, k, v) not yet written to it."""

    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: float
    v_scale: float


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Blocks are handed out in a random order, so block tables are not contiguous; every slot of the cache
    starts with random values, so reading past a context shows up as a wrong result."""
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = []
    for n in blocks_per_seq:
        block_tables.append(order[:n])
        order = order[n:]
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    fp8 = cache_dtype == FP8_DTYPE
    k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = to_cache_dtype(randn(*cache_shape), cache_dtype, k_scale)
    v_cache = to_cache_dtype(randn(*cache_shape), cache_dtype, v_scale)
    meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, device)
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        k_scale=k_scale,
        v_scale=v_scale,
    )
