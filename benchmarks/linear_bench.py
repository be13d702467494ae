"""The bf16-weight linear kernel of CPUs without native bf16 against MKL's float32:
`python -m benchmarks.linear_bench [--rows 1,2,8,16,32,64,96] [--repeats 9] [--threads 2]`.

For each number of rows, every linear of SmolLM2-135M (30 layers of qkv, o, gate_up and down, and the
49,152-row lm_head) multiplies random float32 rows through kvkernels/cpu_bf16_linear.cpp on bf16 panels and
through `F.linear` on the float32 weights, the two taking turns: median milliseconds for all 121 and the ratio.
It is how `worker.model.packed_linear.DECODE_ROWS` was chosen; rerun it on a new kind of CPU. Needs x86 with
AVX2 and FMA (on an AVX-512 machine, emulate with docs/worker.md's variables); elsewhere it exits with code 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvkernels import cpu_linear
from kvkernels.cpu_backend import cpu_description

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 960  # SmolLM2-135M
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [
    (VOCAB, HIDDEN)
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,8,16,32,64,96")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if reason := cpu_linear.unsupported_reason():
        print(f"linear_bench: the bf16 linear kernel cannot run here: {reason}", file=sys.stderr)
        return 2
    if not cpu_linear.load_kernel():
        print("linear_bench: the bf16 linear kernel did not build", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    panels = [cpu_linear.pack_weight(w) for w in weights]
    print(f"{cpu_description()}, {args.threads} threads, medians of {args.repeats}; ms for SmolLM2's 121 matrices")
    print(f"{'rows':>5}  {'MKL float32':>12}  {'bf16 kernel':>12}  {'ratio':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"mkl": [], "kernel": []}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            times["mkl"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for w, p in zip(weights, panels, strict=True):
                cpu_linear.bf16_linear(inputs[w.shape[1]], p, None)
            times["kernel"].append(time.perf_counter() - start)
        mkl_ms, kernel_ms = (statistics.median(t[1:]) * 1e3 for t in (times["mkl"], times["kernel"]))
        print(f"{rows:>5}  {mkl_ms:>12.1f}  {kernel_ms:>12.1f}  {mkl_ms / kernel_ms:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
