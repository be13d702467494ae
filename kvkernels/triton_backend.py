"""The attention backend built on the Triton kernels: the engine's path on CUDA."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kvkernels.attention import AttentionMetadata
from kvkernels.triton_cache_write import write_kv
from kvkernels.triton_decode_attention import paged_decode_attention
from kvkernels.triton_prefill_attention import paged_prefill_attention

MIN_PARTITION_SIZE = 64
MAX_PARTITION_SIZE = 1024


@dataclass
class SeqSplit:
    """The step's sequences by kernel: single-token ones go to the decode kernel, the rest to prefill."""

    decode_seq_ids: torch.Tensor  # int32
    prefill_seq_ids: torch.Tensor  # int32
    max_decode_seq_len: int
    max_prefill_query_len: int


def split_by_kernel(meta: AttentionMetadata) -> SeqSplit:
    key = "triton_seq_split"
    if key not in meta.derived:
        device = meta.seq_lens.device
        decodes = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
        prefills = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len > 1]
        meta.derived[key] = SeqSplit(
            decode_seq_ids=torch.tensor(decodes, dtype=torch.int32, device=device),
            prefill_seq_ids=torch.tensor(prefills, dtype=torch.int32, device=device),
            max_decode_seq_len=max((meta.seq_lens_cpu[i] for i in decodes), default=0),
            max_prefill_query_len=max((meta.query_lens_cpu[i] for i in prefills), default=0),
        )
    return meta.derived[key]


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Tokens per split-KV partition: enough partitions that the decode grid covers the GPU about four times
    over (a batch of one long context still uses every SM), in powers of two so that few variants compile."""
    partitions_wanted = triton.cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads))
    size = triton.next_power_of_2(triton.cdiv(max_seq_len, partitions_wanted))
    return min(max(size, MIN_PARTITION_SIZE), MAX_PARTITION_SIZE)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, partition_size: int | None = None) -> None:
        """partition_size: context tokens per split-KV partition of the decode kernel; None chooses per step."""
        self.partition_size = partition_size

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
        write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

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
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        split = split_by_kernel(meta)
        batch = (meta.query_start_loc, meta.seq_lens, meta.block_tables)
        partition_size = self.partition_size or choose_partition_size(
            split.decode_seq_ids.numel(), k_cache.shape[2], split.max_decode_seq_len, num_sms(q.device)
        )
        paged_decode_attention(
            out, q, k_cache, v_cache, split.decode_seq_ids, *batch, split.max_decode_seq_len,
            softmax_scale, k_scale, v_scale, partition_size,
        )  # fmt: skip
        paged_prefill_attention(
            out, q, k_cache, v_cache, split.prefill_seq_ids, *batch, split.max_prefill_query_len,
            softmax_scale, k_scale, v_scale,
        )  # fmt: skip
        return out
