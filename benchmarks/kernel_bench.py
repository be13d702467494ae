"""GPU benchmark of the attention kernels: `python -m benchmarks.kernel_bench --json OUT`.

Decode: achieved memory bandwidth of the paged decode kernel (bytes of K/V read / time) as a share of the device's
peak, at batch 64 x context 4096 and a small sweep, beside torch SDPA over the same K/V already gathered into
contiguous tensors (the best a non-paged kernel can do) and the torch backend (gather + SDPA). Prefill: TFLOP/s
of the prefill kernel for fresh prompts and an extend over a cached prefix, beside torch SDPA over contiguous K/V
(is_causal, or the extend's mask). Times are medians of triton.testing.do_bench; each case also checks the
kernel's output against torch. Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128),
bfloat16, block 16. Needs CUDA; elsewhere it exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton.testing

from kvkernels.attention import FP8_DTYPE, AttentionMetadata
from kvkernels.torch_attention import TorchAttentionBackend
from kvkernels.triton_backend import TritonAttentionBackend, choose_partition_size, num_sms

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16

# HBM bandwidth in GB/s, matched in order against torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3").
PEAK_BANDWIDTH_GBS = [
    ("GH200", 4000.0),  # the 96 GB HBM3 part; the 144 GB HBM3e one has 4900: pass --peak-gbs
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIE", 2000.0),
    ("H100", 3350.0),  # SXM
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIE", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
]

DECODE_SWEEP = [(64, 4096), (1, 4096), (16, 4096), (64, 1024), (64, 16384), (1, 32768)]
PREFILL_CASES = [(1, 4096, 0), (8, 2048, 0), (4, 512, 4096)]  # (sequences, new tokens each, cached prefix)


@dataclass
class DecodeResult:
    batch: int
    context: int
    kv_dtype: str
    kv_bytes: int
    partition_size: int
    triton_us: float
    triton_gbs: float
    triton_share_of_peak: float
    sdpa_contiguous_us: float | None
    sdpa_contiguous_gbs: float | None
    torch_paged_us: float | None
    max_abs_error: float


@dataclass
class PrefillResult:
    sequences: int
    new_tokens: int
    cached_prefix: int
    tflop: float
    triton_ms: float
    triton_tflops: float
    sdpa_ms: float
    sdpa_tflops: float
    max_abs_error: float


def peak_bandwidth_gbs(device_name: str) -> float | None:
    name = device_name.upper()
    return next((gbs for key, gbs in PEAK_BANDWIDTH_GBS if key in name), None)


def make_step(batch: int, query_len: int, context: int, kv_dtype: torch.dtype, seed: int = 0):
    """A step of `batch` sequences of `context` tokens whose last `query_len` are new, with block tables that
    scatter each sequence over the cache as a long-running server's would, and random K/V everywhere."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    order = torch.randperm(num_blocks, device="cuda", generator=gen).tolist()
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([query_len] * batch, [context] * batch, tables, BLOCK_SIZE, "cuda")
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen).to(kv_dtype)
    q = torch.randn(batch * query_len, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    return q, k_cache, v_cache, meta


def gather_contiguous(cache: torch.Tensor, meta: AttentionMetadata, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] in the model dtype: the paged cache laid out as a non-paged kernel wants it."""
    index = meta.block_tables.long()
    # Gathered as bytes: indexing kernels need not support float8.
    blocks = cache.view(torch.uint8)[index].view(cache.dtype) if cache.dtype == FP8_DTYPE else cache[index]
    blocks = blocks.to(DTYPE)  # [B, blocks, block_size, Hkv, D]
    return blocks.flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def bench_decode(batch: int, context: int, kv_dtype: torch.dtype, peak_gbs: float) -> DecodeResult:
    q, k_cache, v_cache, meta = make_step(batch, 1, context, kv_dtype)
    scale = HEAD_DIM**-0.5
    triton_backend = TritonAttentionBackend()
    out = triton_backend.attend(q, k_cache, v_cache, meta, scale)
    triton_ms = bench_ms(lambda: triton_backend.attend(q, k_cache, v_cache, meta, scale))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()

    k, v = gather_contiguous(k_cache, meta, context), gather_contiguous(v_cache, meta, context)
    grouped_q = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)  # query heads of a KV head
    reference = F.scaled_dot_product_attention(grouped_q, k, v, scale=scale).reshape(q.shape)
    error = (out.float() - reference.float()).abs().max().item()
    sdpa_ms = torch_ms = None
    if kv_dtype == DTYPE:  # the baselines read 16-bit K/V; beside an FP8 cache they would read twice the bytes
        sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(grouped_q, k, v, scale=scale))
        torch_backend = TorchAttentionBackend()
        torch_ms = bench_ms(lambda: torch_backend.attend(q, k_cache, v_cache, meta, scale))
    triton_gbs = kv_bytes / triton_ms / 1e6
    return DecodeResult(
        batch=batch,
        context=context,
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        kv_bytes=kv_bytes,
        partition_size=choose_partition_size(batch, NUM_KV_HEADS, context, num_sms(q.device)),
        triton_us=triton_ms * 1e3,
        triton_gbs=triton_gbs,
        triton_share_of_peak=triton_gbs / peak_gbs,
        sdpa_contiguous_us=sdpa_ms * 1e3 if sdpa_ms else None,
        sdpa_contiguous_gbs=kv_bytes / sdpa_ms / 1e6 if sdpa_ms else None,
        torch_paged_us=torch_ms * 1e3 if torch_ms else None,
        max_abs_error=error,
    )


def bench_prefill(sequences: int, new_tokens: int, prefix: int) -> PrefillResult:
    context = prefix + new_tokens
    q, k_cache, v_cache, meta = make_step(sequences, new_tokens, context, DTYPE)
    scale = HEAD_DIM**-0.5
    backend = TritonAttentionBackend()
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    triton_ms = bench_ms(lambda: backend.attend(q, k_cache, v_cache, meta, scale))
    # Each new token attends to the prefix and to itself and the new tokens before it: 2 matmuls of 2 flops.
    scores_per_seq = new_tokens * prefix + new_tokens * (new_tokens + 1) / 2
    tflop = 4 * sequences * scores_per_seq * NUM_HEADS * HEAD_DIM / 1e12

    group = NUM_HEADS // NUM_KV_HEADS
    k = gather_contiguous(k_cache, meta, context).repeat_interleave(group, dim=1)  # flash SDPA wants equal heads
    v = gather_contiguous(v_cache, meta, context).repeat_interleave(group, dim=1)
    batched_q = q.view(sequences, new_tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    query_positions = torch.arange(prefix, context, device="cuda")
    mask = torch.arange(context, device="cuda")[None, :] <= query_positions[:, None]
    reference = F.scaled_dot_product_attention(batched_q, k, v, attn_mask=mask, scale=scale)
    error = (out.float() - reference.transpose(1, 2).reshape(q.shape).float()).abs().max().item()
    # is_causal aligns the mask top-left, which is right only without a prefix; with one, pass the mask.
    causal = dict(is_causal=True) if prefix == 0 else dict(attn_mask=mask)
    sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(batched_q, k, v, scale=scale, **causal))
    return PrefillResult(
        sequences=sequences,
        new_tokens=new_tokens,
        cached_prefix=prefix,
        tflop=tflop,
        triton_ms=triton_ms,
        triton_tflops=tflop / (triton_ms / 1e3),
        sdpa_ms=sdpa_ms,
        sdpa_tflops=tflop / (sdpa_ms / 1e3),
        max_abs_error=error,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write the results here as JSON")
    parser.add_argument("--peak-gbs", type=float, help="the device's peak memory bandwidth in GB/s (default: by name)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    if args.peak_gbs is not None and args.peak_gbs <= 0:
        print(f"kernel_bench: --peak-gbs must be > 0, got {args.peak_gbs}", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    peak_gbs = args.peak_gbs or peak_bandwidth_gbs(device_name)
    if peak_gbs is None:
        print(f"kernel_bench: unknown peak bandwidth for {device_name!r}; pass --peak-gbs", file=sys.stderr)
        return 2
    print(f"{device_name}: peak {peak_gbs:.0f} GB/s; heads {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}, {DTYPE}")

    decode = []
    cases = [(batch, context, DTYPE) for batch, context in DECODE_SWEEP] + [(64, 4096, FP8_DTYPE)]
    for batch, context, kv_dtype in cases:
        result = bench_decode(batch, context, kv_dtype, peak_gbs)
        torch.cuda.empty_cache()  # the next case's caches may be larger
        decode.append(result)
        baseline = f"{result.sdpa_contiguous_gbs:7.0f} GB/s" if result.sdpa_contiguous_gbs else "      -"
        print(
            f"decode  B={batch:<3} ctx={context:<6} {result.kv_dtype:<14} split {result.partition_size:<4} "
            f"triton {result.triton_us:8.1f} us "
            f"{result.triton_gbs:7.0f} GB/s ({result.triton_share_of_peak:5.1%} of peak)  "
            f"sdpa(contiguous) {baseline}  err {result.max_abs_error:.2e}"
        )
    prefill = []
    for sequences, new_tokens, prefix in PREFILL_CASES:
        timing = bench_prefill(sequences, new_tokens, prefix)
        torch.cuda.empty_cache()
        prefill.append(timing)
        print(
            f"prefill seqs={sequences:<2} new={new_tokens:<5} prefix={prefix:<5} triton {timing.triton_ms:7.3f} ms "
            f"{timing.triton_tflops:6.1f} TFLOP/s  sdpa {timing.sdpa_tflops:6.1f} TFLOP/s  "
            f"err {timing.max_abs_error:.2e}"
        )
    if args.json:
        report = {
            "device": device_name,
            "peak_gbs": peak_gbs,
            "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
            "dtype": str(DTYPE).removeprefix("torch."),
            "block_size": BLOCK_SIZE,
            "decode": [asdict(r) for r in decode],
            "prefill": [asdict(r) for r in prefill],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
