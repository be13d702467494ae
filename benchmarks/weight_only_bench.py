"""Where weight-only quantization pays on this CPU: the kernel against the float path by step size, and the whole
engine's int4 (or int8) against float decode speed by batch size and context length, and prefill by prompt length.

    python -m benchmarks.weight_only_bench [--sections kernel,sweep] [--weights int4] [--json OUT] [--plot OUT.png]
        [--threads 2] [--repeats 3]

  kernel  SmolLM2's matrices (qkv, o, gate_up, down, the tied lm_head) at 1 to 128 rows: the C++ kernel
          (kvkernels/cpu_weight_only.py) against dequantize-then-GEMM in the engine's dtype and against the float
          weight's own GEMM: the medians, and the step size from which dequantize-then-GEMM wins
          (cpu_weight_only.DEQUANTIZE_ABOVE_ROWS).
  sweep   the engine (`auto` dtype) with `--weights float` and the candidate: a decode step's time with 1 to 128
          streams over contexts of 64, 512 and 2,048 tokens (the streams share their prompt's cached prefix, so a
          point costs one prefill), and prefill tokens/s at 16 to 4,096 tokens; the ratios float / candidate.
The PNG shows the decode ratio against batch size, a line a context length, and the prefill ratio against prompt
length: where the advantage shrinks and where it ends. Each figure is a median of `--repeats`, the two engines
taking turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvkernels import cpu_weight_only, weight_only
from kvkernels.cpu_backend import cpu_description
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

SECTIONS = ("kernel", "sweep")
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (64, 512, 2048)
PROMPTS = (16, 64, 256, 1024, 4096)
DECODE_STEPS = 6
# SmolLM2-135M's linears as (name, out_features, in_features).
MATRICES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576))


def median_seconds(repeats: int, inner: int, fn: Callable, *args) -> float:
    """The median over `repeats` of fn(*args)'s seconds, each the mean of `inner` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn(*args)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


dequantized = cpu_weight_only.dequantized_linear


def kernel_section(bits: int, repeats: int) -> dict:
    """ms of a linear by matrix and rows: the kernel, dequantize-then-GEMM (bf16) and the bf16 weight's GEMM."""
    if not cpu_weight_only.load_kernel():
        return {"skipped": cpu_weight_only.unsupported_reason()}
    out: dict = {}
    for name, n, k in MATRICES:
        weight = torch.randn(n, k) * 0.05
        quantized = weight_only.quantize(weight, bits, 32, symmetric=False)
        packed = cpu_weight_only.pack(quantized)
        bf16 = weight.to(torch.bfloat16)
        rows: dict = {}
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            inner = max(1, 200 // m)
            rows[str(m)] = {
                "kernel_ms": 1e3 * median_seconds(repeats, inner, cpu_weight_only.linear, x, packed),
                "dequantize_gemm_ms": 1e3 * median_seconds(repeats, inner, dequantized, x, packed),
                "float_ms": 1e3 * median_seconds(repeats, inner, F.linear, x, bf16),
            }
        crossover = next((m for m in ROWS if rows[str(m)]["dequantize_gemm_ms"] < rows[str(m)]["kernel_ms"]), None)
        out[name] = {"rows": rows, "dequantize_wins_from_rows": crossover}
        print(f"kernel int{bits} {name} [{n}x{k}]: dequantize-then-GEMM wins from {crossover} rows", flush=True)
    return out


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, corpus_start: int) -> float:
    """The median decode step of `batch` streams over `context` tokens: their prompts share `context - 1` tokens,
    prefilled once by a request ahead of them, so that each stream prefills only its last block."""
    shared = [(corpus_start + i) % 30000 + 100 for i in range(context - 1)]
    engine.generate([shared], SamplingParams(max_tokens=1, temperature=0.0))
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    tokens = {f"s{corpus_start}-{i}": 0 for i in range(batch)}
    for i, request_id in enumerate(tokens):
        engine.add_request(request_id, shared + [5000 + i], params)
    steps = []
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())  # every stream past its first token: a pure decode step
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outs:
            tokens[out.request_id] += len(out.new_token_ids)
        if decoding and len(outs) == batch:
            steps.append(elapsed)
    return statistics.median(steps)


def prefill_seconds(engine: LLMEngine, length: int, corpus_start: int) -> float:
    prompt = [(corpus_start + i) % 30000 + 100 for i in range(length)]
    request_id = f"p{corpus_start}-{length}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def sweep_section(model: str, candidate: str, repeats: int) -> dict:
    engines = {
        w: LLMEngine(
            EngineConfig(model=model, weights=w, max_num_seqs=max(BATCHES), max_num_batched_tokens=max(PROMPTS))
        )
        for w in ("float", candidate)
    }
    fresh = iter(range(0, 10**9, 7919))  # each run a new prompt: nothing cached from the previous
    decode: dict = {}
    for context in CONTEXTS:
        for batch in BATCHES:
            times: dict[str, list[float]] = {w: [] for w in engines}
            for _ in range(repeats):
                for w, engine in engines.items():
                    times[w].append(decode_step_seconds(engine, batch, context, next(fresh)))
            ms = {w: 1e3 * statistics.median(t) for w, t in times.items()}
            decode[f"{context}x{batch}"] = {
                "context": context,
                "batch": batch,
                "float_ms": ms["float"],
                "candidate_ms": ms[candidate],
                "ratio": ms["float"] / ms[candidate],
            }
            print(f"decode context {context} batch {batch}: {decode[f'{context}x{batch}']}", flush=True)
    prefill: dict = {}
    for length in PROMPTS:
        times = {w: [] for w in engines}
        for _ in range(repeats):
            for w, engine in engines.items():
                times[w].append(prefill_seconds(engine, length, next(fresh)))
        seconds = {w: statistics.median(t) for w, t in times.items()}
        prefill[str(length)] = {
            "tokens": length,
            "float_tok_s": length / seconds["float"],
            "candidate_tok_s": length / seconds[candidate],
            "ratio": seconds["float"] / seconds[candidate],
        }
        print(f"prefill {length}: {prefill[str(length)]}", flush=True)
    dtype = str(engines["float"].dtype).removeprefix("torch.")
    return {"candidate": candidate, "dtype": dtype, "decode": decode, "prefill": prefill}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["sweep"]
    name = sweep["candidate"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for context in CONTEXTS:
        points = [row for row in sweep["decode"].values() if row["context"] == context]
        left.plot([p["batch"] for p in points], [p["ratio"] for p in points], marker="o", label=f"context {context}")
    left.set_xscale("log", base=2)
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xlabel("streams in the decode step (batch size)")
    left.set_ylabel(f"decode step: float time / {name} time")
    left.set_title(f"decode: {name} against float ({sweep['dtype']})")
    left.legend()
    prefill = list(sweep["prefill"].values())
    right.plot([p["tokens"] for p in prefill], [p["ratio"] for p in prefill], marker="o", color="C3")
    right.set_xscale("log", base=2)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("prompt tokens")
    right.set_ylabel(f"prefill: float time / {name} time")
    right.set_title("prefill")
    fig.suptitle(f"{report['model']} on {report['cpu']}, {report['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    parser.add_argument("--weights", default="int4", choices=("int8", "int4"), help="the candidate against float")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="a PNG of the sweep's ratios")
    args = parser.parse_args()
    sections = tuple(args.sections.split(","))
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(args.threads)
    report: dict = {"model": args.model, "cpu": cpu_description(), "threads": args.threads, "repeats": args.repeats}
    print(f"cpu: {report['cpu']}", flush=True)
    bits = 4 if args.weights == "int4" else 8
    if "kernel" in sections:
        report["kernel"] = kernel_section(bits, args.repeats)
    if "sweep" in sections:
        report["sweep"] = sweep_section(args.model, args.weights, args.repeats)
        if args.plot:
            plot(report, args.plot)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
