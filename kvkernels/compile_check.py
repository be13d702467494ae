"""Compile the Triton kernels for CUDA GPUs on a machine without one: `python -m kvkernels.compile_check`.

TRITON_INTERPRET=1 runs the kernels' arithmetic on the CPU but never compiles them, so a kernel that the GPU
compiler rejects (a tl.dot below 16 wide, e4m3 on sm_80, a type mismatch between branches) would pass every
interpreted test. This compiles each variant the backends launch, down to a cubin, for sm_80 (FP8 caches as
bytes) and sm_90 (native e4m3), with the argument alignment Triton assumes for real tensors.
Run it in a fresh process without TRITON_INTERPRET: triton.jit reads that variable when the kernels are imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvkernels.attention import FP8_MAX
from kvkernels.triton_cache_write import write_kv_kernel
from kvkernels.triton_decode_attention import combine_partitions_kernel, paged_decode_kernel
from kvkernels.triton_prefill_attention import paged_prefill_kernel
from kvkernels.triton_weight_only import BLOCK_M, BLOCK_N, weight_only_linear_kernel

INDEX_POINTERS = {"seq_ids_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"}
FLOAT32_POINTERS = {"partial_out_ptr", "max_logits_ptr", "exp_sums_ptr"}
FLOAT_SCALARS = {"k_scale", "v_scale", "softmax_scale_log2"}
TL_BY_NAME = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


@dataclass
class Variant:
    name: str
    kernel: Any
    dtype: str  # activations
    cache_dtype: str
    out_dtype: str
    constexprs: dict[str, Any]
    num_warps: int = 4
    pointer_types: dict[str, str] | None = None  # the pointers' types, where the attention kernels' rules don't say

    def signature(self) -> dict[str, str]:
        types = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                types[name] = "constexpr"
            elif self.pointer_types and name in self.pointer_types:
                types[name] = self.pointer_types[name]
            elif name in INDEX_POINTERS:
                types[name] = "*i32"
            elif name == "slot_mapping_ptr":
                types[name] = "*i64"
            elif name in FLOAT32_POINTERS:
                types[name] = "*fp32"
            elif name in ("k_cache_ptr", "v_cache_ptr"):
                types[name] = "*" + self.cache_dtype
            elif name == "out_ptr":
                types[name] = "*" + self.out_dtype
            elif name.endswith("_ptr"):
                types[name] = "*" + self.dtype
            else:
                types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
        return types

    def compile(self, target: GPUTarget) -> Any:
        names = self.kernel.arg_names
        types = self.signature()
        # Pointers and strides divisible by 16, as Triton specialises them for real tensors (block table rows
        # and group-scale rows, K / group_size, are not).
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(names)
            if types[name] != "constexpr"
            and (types[name].startswith("*") or name.startswith("stride"))
            and name not in ("stride_block_table", "stride_sn")
        }
        constants = {(names.index(name),): value for name, value in self.constexprs.items()}
        source = ASTSource(self.kernel, types, constants, aligned)
        return triton.compile(source, target=target, options={"num_warps": self.num_warps})


def variants(arch: int, everything: bool) -> Iterator[Variant]:
    """The variants the wrappers launch: Llama's shapes in bfloat16 and SmolLM2's in float32, with a 16/32-bit
    and an FP8 cache. sm_80 differs from sm_90 only in how it reads FP8, so by default it compiles only those."""
    fp8 = "fp8e4nv" if arch >= 89 else "u8"
    shapes = [(128, 4, "bf16"), (64, 3, "fp32")] + ([(128, 4, "fp32"), (64, 3, "bf16")] if everything else [])
    for head_dim, group, dtype in shapes:
        dot = dict(DOT_DTYPE=TL_BY_NAME[dtype], DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        shape = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim)
        for cache in [fp8] if arch < 89 and not everything else [dtype, fp8]:
            tag = f"sm_{arch} d{head_dim} g{group} {dtype} cache {cache}"
            write = dict(NUM_KV_HEADS=8, BLOCK_H=8, FP8=cache == fp8, FP8_MAX=FP8_MAX)
            yield Variant(f"write_kv {tag}", write_kv_kernel, dtype, cache, dtype, shape | write)
            for split in (False, True):
                decode = dict(GROUP=group, PAGE_SIZE=16, PARTITION_SIZE=512, BLOCK_G=16, BLOCK_N=64, SPLIT=split)
                out_dtype = "fp32" if split else dtype
                name = f"paged_decode split={split} {tag}"
                yield Variant(name, paged_decode_kernel, dtype, cache, out_dtype, shape | decode | dot)
            prefill = dict(GROUP=group, PAGE_SIZE=16, BLOCK_M=64, BLOCK_N=64)
            yield Variant(f"paged_prefill {tag}", paged_prefill_kernel, dtype, cache, dtype, shape | prefill | dot, 8)
        combine = dict(PARTITION_SIZE=512, BLOCK_P=32)
        name = f"combine_partitions sm_{arch} d{head_dim} {dtype}"
        yield Variant(name, combine_partitions_kernel, dtype, dtype, dtype, shape | combine)
    yield from weight_only_variants(arch, everything)


def weight_only_variants(arch: int, everything: bool) -> Iterator[Variant]:
    """The weight-only linear kernel: int8 and int4 at SmolLM2's group size (32) and the largest (128), with
    bfloat16 activations, and float32 too with --all."""
    for dtype in ["bf16"] + (["fp32", "fp16"] if everything else []):
        for bits, q_type in ((8, "*i8"), (4, "*u8")):
            for group_size in (32, 128):
                pointers = {"q_ptr": q_type, "scales_ptr": "*fp16", "offsets_ptr": "*fp16"}
                constexprs = dict(
                    BITS=bits,
                    GROUP_SIZE=group_size,
                    HAS_BIAS=True,
                    BLOCK_M=BLOCK_M,
                    BLOCK_N=BLOCK_N,
                    DOT_DTYPE=TL_BY_NAME[dtype],
                    DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                )
                name = f"weight_only_linear sm_{arch} int{bits} g{group_size} {dtype}"
                kernel = weight_only_linear_kernel
                yield Variant(name, kernel, dtype, dtype, dtype, constexprs, pointer_types=pointers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="both head dims with both dtypes (slower)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET; the interpreter compiles nothing", file=sys.stderr)
        return 2
    failures = 0
    for arch in (80, 90):
        target = GPUTarget("cuda", arch, 32)
        for variant in variants(arch, args.all):
            try:
                compiled = variant.compile(target)
                print(f"ok    {variant.name}: {compiled.metadata.shared} B shared memory")
            except Exception as error:  # report every failing variant, not only the first
                failures += 1
                print(f"FAIL  {variant.name}: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
