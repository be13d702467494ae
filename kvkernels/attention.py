"""The attention contract between the model, the engine and the kernels.

One engine step runs a flat batch of T new tokens from B sequences (prefill chunks, extends over a cached
prefix and decodes, mixed, in any order). `AttentionMetadata` describes that batch; an `AttentionBackend`
writes the step's new K/V into the paged cache and computes attention for the new tokens.

KV cache per layer: `k_cache, v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim], dtype the
model dtype or torch.float8_e4m3fn. An FP8 cache has one per-tensor scale per cache (k_scale, v_scale):
stored = clamp(x / scale) cast to e4m3, read = stored.float() * scale. Scales are ignored for other dtypes.
The slot of token position p of a sequence is block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


@dataclass
class AttentionMetadata:
    """One step's batch. The new tokens of seq i are q[query_start_loc[i]:query_start_loc[i+1]] at positions
    seq_lens[i] - query_len_i ... seq_lens[i] - 1; they attend causally to themselves and fully to the seq's
    earlier context read from the cache."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token (-1 = do not write)
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached prefix + new tokens)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Tensors a backend derives from the metadata once per step and reuses in every layer.
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from host lists; every new token gets its slot (none is -1).

        block_tables[i] must hold at least ceil(seq_lens[i] / block_size) block ids."""
        _check_batch(query_lens, seq_lens, block_tables, block_size)
        width = max(1, max(len(t) for t in block_tables))
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        q_lens = torch.tensor(query_lens)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, dim=0, out=starts[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T]: each token's seq
        positions = token_positions(query_lens, seq_lens)
        slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
        return cls(
            slot_mapping=slots.to(device),
            query_start_loc=starts.to(device=device, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device=device, dtype=torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


def token_positions(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """int64 [T]: the position of each new token in its sequence (seq i's run seq_len - q_len ... seq_len - 1)."""
    q_lens = torch.tensor(query_lens)
    first = torch.tensor(seq_lens) - q_lens  # [B]: position of each seq's first new token
    starts = torch.cumsum(q_lens, dim=0) - q_lens  # [B]: row of each seq's first new token
    seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    return torch.arange(int(q_lens.sum())) - starts[seq_index] + first[seq_index]


def _check_batch(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not query_lens:
        raise ValueError("query_lens is empty: a step needs at least one sequence")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens, seq_lens and block_tables differ in length: "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    for i, (q_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 1 <= q_len <= seq_len:
            raise ValueError(f"seq {i}: query_len {q_len} must be in [1, seq_len={seq_len}]")
        if len(table) * block_size < seq_len:
            raise ValueError(f"seq {i}: block_table of {len(table)} blocks cannot hold seq_len {seq_len}")


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, clamped to the e4m3 range, as float8_e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    return quantize_fp8(x, scale) if cache_dtype == FP8_DTYPE else x.to(cache_dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Read values from a cache of any supported dtype as `dtype` (dequantising FP8 with `scale`)."""
    if x.dtype == FP8_DTYPE:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


class AttentionBackend(Protocol):
    """Paged attention for one layer. The model calls write_kv with the step's new K/V (after RoPE), then
    attend. Both take the same metadata; attend reads all K/V, the new tokens' included, from the cache."""

    name: str

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """k, v: [T, num_kv_heads, head_dim]. Token t goes to slot slot_mapping[t] (-1 = skip), quantised to
        FP8 with the cache's scale when the cache is FP8."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim] in q's dtype.
        GQA: num_heads % num_kv_heads == 0; query head h reads KV head h // (num_heads // num_kv_heads)."""
        ...
