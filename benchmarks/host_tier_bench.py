"""What a host-tier copy costs against recomputing the same tokens, on this machine's worker.

    python -m benchmarks.host_tier_bench [--model smollm2] [--tokens 512,2048,8000] [--repeats 5] [--json OUT]
        [--device cuda]

For each prompt length: the model runner's copy of that many tokens' KV blocks (every layer's K and V) to the
host tier and back (`ModelRunner.copy_to_host` / `copy_from_host`, the worker's own code), in GB/s, against the
prefill of the same tokens (a fresh prompt, nothing cached): the ratio is what a prefix hit in the host tier
saves over recomputing it. Medians of `--repeats`, the copy and the prefill taking turns. The engine's `auto`
dtype; 2 threads. With `--device cuda` the same copies cross PCIe, to pinned host memory (loadtest/gpu_check.sh
runs it there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvkernels.cpu_backend import cpu_description
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner, kv_bytes_per_block


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_seconds(runner: ModelRunner, blocks: int) -> tuple[float, float]:
    ids, slots = list(range(blocks)), list(range(blocks))
    synchronize(runner.device)
    start = time.perf_counter()
    runner.copy_to_host(ids, slots)
    synchronize(runner.device)
    middle = time.perf_counter()
    runner.copy_from_host(slots, ids)
    synchronize(runner.device)
    return middle - start, time.perf_counter() - middle


def prefill_seconds(engine: LLMEngine, tokens: int, seed: int) -> float:
    prompt = [(seed * 7919 + i * 104729) % 30000 + 100 for i in range(tokens)]
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", default="512,2048,8000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(t) for t in args.tokens.split(",")]
    longest = max(lengths)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_model_len=longest + 16,
        max_num_batched_tokens=2048,
        num_kv_blocks=longest // 16 + 8,
        host_kv_blocks=longest // 16 + 8,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "the host-tier bench runs a model"
    engine.warm_up()
    block_bytes = kv_bytes_per_block(runner.model_config, config.block_size, runner.kv_cache_dtype)
    where = torch.cuda.get_device_name() if runner.device.type == "cuda" else cpu_description()
    report: dict = {"model": args.model, "device": where, "dtype": str(engine.dtype), "rows": []}
    print(f"{args.model} ({engine.dtype}) on {where}, {args.threads} threads, medians of {args.repeats}")
    header = ("tokens", 7), ("MB", 8), ("to host GB/s", 13), ("back GB/s", 10), ("back ms", 8), ("prefill ms", 11)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'ratio':>7}")
    for tokens in lengths:
        blocks = tokens // config.block_size
        out, back, prefill = [], [], []
        for repeat in range(args.repeats):
            save, restore = copy_seconds(runner, blocks)
            out.append(save)
            back.append(restore)
            prefill.append(prefill_seconds(engine, tokens, seed=tokens * 31 + repeat))
        megabytes = blocks * block_bytes / 1e6
        row = {
            "tokens": tokens,
            "bytes": blocks * block_bytes,
            "to_host_gb_s": megabytes / 1e3 / statistics.median(out),
            "from_host_gb_s": megabytes / 1e3 / statistics.median(back),
            "from_host_ms": 1e3 * statistics.median(back),
            "prefill_ms": 1e3 * statistics.median(prefill),
        }
        row["prefill_over_copy"] = row["prefill_ms"] / row["from_host_ms"]
        report["rows"].append(row)
        print(
            f"{tokens:>7} {megabytes:>8.1f} {row['to_host_gb_s']:>13.2f} {row['from_host_gb_s']:>10.2f} "
            f"{row['from_host_ms']:>8.2f} {row['prefill_ms']:>11.1f} {row['prefill_over_copy']:>6.0f}x",
            flush=True,
        )
    engine.check_invariants()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
