"""CPU benchmark of the C++ attention kernels: `python -m benchmarks.cpu_kernel_bench [--fp32] [--json OUT]`.

For each case, the kernel (kvkernels/cpu_attention.cpp, through CpuAttentionBackend) against the torch path
(TorchAttentionBackend: SDPA over K/V gathered from the cache) on the same paged step, in the same run: median
milliseconds per layer, GFLOP/s of attention (QK^T and PV, causal work only) and the speedup; each case also
reports the largest difference between the two outputs. Shapes are SmolLM2-135M's attention (9 query heads,
3 KV heads, head_dim 64), bfloat16 (one case with an FP8 KV cache), block 16. Needs a CPU with AVX-512 BF16;
elsewhere it exits with code 2.

`--fp32`: the AVX2 float32 kernel (kvkernels/cpu_attention_fp32.cpp) on float32 steps instead (FP32_CASES), the
two paths taking turns call by call, so that a shared machine's load falls on both alike. Needs AVX2 and FMA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvkernels.attention import FP8_DTYPE
from kvkernels.cpu_backend import (
    CpuAttentionBackend,
    fp32_unsupported_reason,
    load_fp32_kernel,
    load_kernel,
    unsupported_reason,
)
from kvkernels.reference import make_paged_batch
from kvkernels.torch_attention import TorchAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (name, new tokens per sequence, context per sequence after the step, sequences, KV cache dtype)
CASES = [
    ("prefill 3000", 3000, 3000, 1, torch.bfloat16),
    ("extend 400 over 2900 cached", 400, 3300, 1, torch.bfloat16),
    ("decode 32 x 264", 1, 264, 32, torch.bfloat16),
    ("decode 32 x 1000", 1, 1000, 32, torch.bfloat16),
    ("decode 32 x 1000, FP8 KV", 1, 1000, 32, FP8_DTYPE),
    ("decode 1 x 3300", 1, 3300, 1, torch.bfloat16),
]
FP32_CASES = [
    ("prefill 1000", 1000, 1000, 1, torch.float32),
    ("prefill 2048", 2048, 2048, 1, torch.float32),
    ("extend 952 over 2048 cached", 952, 3000, 1, torch.float32),
    ("decode 1 x 250", 1, 250, 1, torch.float32),
    ("decode 32 x 250", 1, 250, 32, torch.float32),
    ("decode 32 x 250, FP8 KV", 1, 250, 32, FP8_DTYPE),
]


def attention_flops(query_len: int, seq_len: int, num_seqs: int) -> float:
    """QK^T and PV over the keys each query sees (its prefix and the new tokens up to itself)."""
    prefix = seq_len - query_len
    pairs = query_len * prefix + query_len * (query_len + 1) / 2
    return num_seqs * pairs * NUM_HEADS * HEAD_DIM * 4


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_ms(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median milliseconds of a and of b, called in turns (a, b, a, b, ...)."""
    times: tuple[list[float], list[float]] = ([], [])
    a(), b()
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def bench_case(
    name: str, query_len: int, seq_len: int, num_seqs: int, cache_dtype: torch.dtype, repeats: int, fp32: bool = False
) -> dict:
    dtype = torch.float32 if fp32 else torch.bfloat16
    batch = make_paged_batch(
        [query_len] * num_seqs,
        [seq_len] * num_seqs,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        dtype,
        cache_dtype,
    )
    args = (batch.k_cache, batch.v_cache, batch.meta, HEAD_DIM**-0.5, batch.k_scale, batch.v_scale)
    kernel, torch_path = CpuAttentionBackend(), TorchAttentionBackend()
    if fp32:  # the kernel itself, on AVX-512 CPUs too, where the backend keeps SDPA
        op = torch.ops.kvroute_cpu_fp32.paged_attention
        kernel_ms, torch_ms = interleaved_ms(
            lambda: kernel.call_kernel(op, batch.q, *args), lambda: torch_path.attend(batch.q, *args), repeats
        )
        kernel_out = kernel.call_kernel(op, batch.q, *args)
    else:
        kernel_ms = median_ms(lambda: kernel.attend(batch.q, *args), repeats)
        torch_ms = median_ms(lambda: torch_path.attend(batch.q, *args), repeats)
        kernel_out = kernel.attend(batch.q, *args)
    diff = (kernel_out.float() - torch_path.attend(batch.q, *args).float()).abs().max().item()
    flops = attention_flops(query_len, seq_len, num_seqs)
    return {
        "case": name,
        "kernel_ms": kernel_ms,
        "torch_ms": torch_ms,
        "speedup": torch_ms / kernel_ms,
        "kernel_gflops": flops / kernel_ms / 1e6,
        "torch_gflops": flops / torch_ms / 1e6,
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--fp32", action="store_true", help="the AVX2 float32 kernel on float32 steps")
    args = parser.parse_args(argv)
    reason, loaded = (fp32_unsupported_reason(), load_fp32_kernel) if args.fp32 else (unsupported_reason(), load_kernel)
    if reason is not None or not loaded():
        print(f"cpu_kernel_bench: the kernel cannot run here: {reason or 'it did not build'}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = []
    for case in FP32_CASES if args.fp32 else CASES:
        row = bench_case(*case, args.repeats, fp32=args.fp32)
        results.append(row)
        print(
            f"{row['case']:<30} kernel {row['kernel_ms']:7.2f} ms ({row['kernel_gflops']:5.0f} GFLOP/s)   "
            f"torch {row['torch_ms']:7.2f} ms ({row['torch_gflops']:5.0f} GFLOP/s)   "
            f"{row['speedup']:4.2f}x   max |diff| {row['max_abs_diff']:.1e}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "fp32": args.fp32, "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
