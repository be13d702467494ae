"""Engine benchmark on CPU: kvroute's engine against HF transformers on the same weights, in one run.

    python -m benchmarks.engine_bench --model smollm2 --json OUT [--threads 2] [--repeats 5] [--sections prefill,...]
        [--dtype auto] [--weights float,int8,int4]

To measure another CPU's branch on this one, hide its features and cap oneDNN, MKL and ATen to its ISA, e.g. an
AVX2-only CPU: KVROUTE_CPU_HIDE_FLAGS=avx512f,avx512bw,avx512vl,avx512_bf16,amx_bf16 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2. The report names the CPU, the dtype and attention path
taken, and why.

Measures (medians of `--repeats` runs; in prefill, decode_b1 and throughput the engines and transformers take
turns, run by run, so that a shared machine's load, and on a VM its host's memory bandwidth and L3 share,
falls on all alike):
  prefix_ttft   TTFT of a 3,300-token prompt whose first 2,900 tokens are cached vs the same prompt uncached;
  throughput    32 concurrent ~200-token prompts x 64 output tokens: kvroute vs transformers' batched generate
                (left-padded, greedy), output tokens/s end to end, fresh prompts every run;
  decode_b1     single-stream decode tokens/s (after the first token);
  prefill       prompt tokens/s at 1,000 and 3,000 tokens: kvroute fp32, kvroute bf16, transformers fp32;
  bf16_quality  kvroute bf16 against kvroute fp32 over a few hundred positions of real text: top-1 agreement
                and mean KL(fp32 || bf16).
With `--weights` (a list of `--weights` values, the first the baseline; the sections above are skipped unless
`--sections` names them): each configuration at the engine's `--dtype`, in one run, taking turns:
  weights       single-stream decode tokens/s and its ratio to the first, the model's bytes against its float32
                bytes, and the greedy answers (32 tokens) of 8 prompts against the first's: how many identical, and
                where the others first differ (`kvroute quality` judges such differences; docs/quantization.md).
kvroute's headline figures (`prefix_ttft`, `throughput.kvroute_tok_s`, `decode_b1.kvroute_tok_s`) are for the
engine's `--dtype` (default auto, what `kvroute worker` serves), named in `dtype` with `dtype_reason` (auto:
bfloat16 where the CPU has bf16 instructions, else float32 with bfloat16 weight copies for decode steps); each
section repeats them for plain float32 under `*_fp32` keys (the same engine, measured once, when it is plain
float32). Transformers runs in float32. Text comes from the docstrings of the Python standard
library, so the benchmark needs no download.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvkernels.cpu_backend import cpu_description
from kvroute.sampling import SamplingParams
from worker.config import WEIGHTS, EngineConfig
from worker.engine import LLMEngine
from worker.model_runner import ModelRunner

STDLIB_MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "functools",
    "heapq",
    "http",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "re",
    "sqlite3",
    "string",
    "subprocess",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib",
    "zipfile",
]
PREFIX_PROMPT, PREFIX_CACHED = 3300, 2900
SECTIONS = ("prefill", "prefix_ttft", "decode_b1", "throughput", "bf16_quality")
WEIGHT_PROMPTS, WEIGHT_PROMPT_TOKENS, WEIGHT_ANSWER_TOKENS = 8, 100, 32
THROUGHPUT_REQUESTS, THROUGHPUT_PROMPT, OUTPUT_TOKENS = 32, 200, 64


def real_text() -> str:
    """A few hundred KB of English prose and code: the standard library's module and class docstrings."""
    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(module.__doc__ or "")
        for value in vars(module).values():
            doc = getattr(value, "__doc__", None) if isinstance(value, type) else None
            if isinstance(doc, str) and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


def interleaved_medians(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """The median of each of `fns` (each returns seconds), run in turn `repeats` times, so that the load of a
    shared machine falls on all of them alike and their ratios hold."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    return {name: statistics.median(values) for name, values in times.items()}


class Corpus:
    """Consecutive slices of one long tokenised text. Each slice starts with a token of its own (the text
    wraps around when used up), so no two prompts share a cached prefix by accident."""

    def __init__(self, token_ids: list[int]) -> None:
        self.ids = token_ids
        self.offset = 0
        self.num_taken = 0

    def take(self, n: int) -> list[int]:
        if self.offset + n > len(self.ids):
            self.offset = 0
        out = self.ids[self.offset : self.offset + n]
        out[0] = 1000 + self.num_taken  # an ordinary word piece, different for every slice
        self.offset += n
        self.num_taken += 1
        return out


# -- kvroute ----------------------------------------------------------------------------------------


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the prompt tokens served from the cache."""
    request_id = f"ttft-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed, out.cached_tokens


def prefix_ttft(engine: LLMEngine, corpus: Corpus, repeats: int) -> dict:
    uncached, cached = [], []
    for _ in range(repeats):
        prompt = corpus.take(PREFIX_PROMPT)
        seconds, hit = ttft(engine, prompt)
        assert hit == 0
        uncached.append(seconds)
        prefix = corpus.take(PREFIX_CACHED)
        ttft(engine, prefix + corpus.take(16))  # an earlier request leaves the 2,900-token prefix cached
        seconds, hit = ttft(engine, prefix + corpus.take(PREFIX_PROMPT - PREFIX_CACHED))
        assert hit >= PREFIX_CACHED - engine.config.block_size, hit
        cached.append(seconds)
    uncached_ms, cached_ms = statistics.median(uncached) * 1e3, statistics.median(cached) * 1e3
    return {"uncached_ms": uncached_ms, "cached_ms": cached_ms, "speedup": uncached_ms / cached_ms}


def kvroute_throughput(engine: LLMEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def kvroute_decode(engine: LLMEngine, prompt: list[int]) -> float:
    """Tokens/s of one stream after its first token."""
    engine.add_request("decode", prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def decode_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds a token of one stream's decode."""
    return 1 / kvroute_decode(engine, prompt)


def bf16_quality(fp32: LLMEngine, bf16: LLMEngine, prompts: list[list[int]]) -> dict:
    agree, kl, positions = 0.0, 0.0, 0
    for prompt in prompts:
        ref = fp32.prompt_logits(prompt, cache_salt="uncached").log_softmax(-1)
        low = bf16.prompt_logits(prompt, cache_salt="uncached").log_softmax(-1)
        agree += (ref.argmax(-1) == low.argmax(-1)).sum().item()
        kl += (ref.exp() * (ref - low)).sum(-1).sum().item()
        positions += len(prompt)
    return {"positions": positions, "top1_agreement": agree / positions, "mean_kl": kl / positions}


def model_bytes(engine: LLMEngine) -> tuple[int, int]:
    """The bytes of the engine's model (parameters, buffers and packed weights such as PackedLinear's oneDNN copy,
    each tensor once: a tied table is one) and the same model's bytes in float32 (every parameter at 4 bytes; a
    quantized layer counted by the float weight it stands for)."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "the engine bench runs a model, not the sim runner"
    tensors = {
        id(t): t
        for module in runner.model.modules()
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values())
        if isinstance(t, torch.Tensor)
    }
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    config = runner.model.config
    with torch.device("meta"):
        float32 = 4 * sum(p.numel() for p in type(runner.model)(config).parameters())
    return held, float32


def greedy_answers(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=WEIGHT_ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    return [result.token_ids for result in engine.generate(prompts, params)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def weights_section(model: str, weights: list[str], dtype_name: str, corpus: Corpus, repeats: int) -> dict:
    """Decode speed, bytes and greedy answers of each `--weights` configuration against the first's."""
    engines = {w: LLMEngine(EngineConfig(model=model, dtype=dtype_name, weights=w)) for w in weights}
    short = corpus.take(20)
    seconds = interleaved_medians({w: functools.partial(decode_seconds, e, short) for w, e in engines.items()}, repeats)
    prompts = [corpus.take(WEIGHT_PROMPT_TOKENS) for _ in range(WEIGHT_PROMPTS)]
    answers = {w: greedy_answers(e, prompts) for w, e in engines.items()}
    base = weights[0]
    rows: dict = {}
    for w, engine in engines.items():
        held, float32 = model_bytes(engine)
        differences = [first_difference(a, b) for a, b in zip(answers[w], answers[base], strict=True)]
        rows[w] = {
            "dtype": str(engine.dtype).removeprefix("torch."),
            "decode_tok_s": 1 / seconds[w],
            "decode_ratio": seconds[base] / seconds[w],
            "model_mib": held / 2**20,
            "bytes_vs_float32": held / float32,
            "greedy_identical": sum(d is None for d in differences),
            "greedy_first_difference": [d for d in differences if d is not None],
        }
        print(f"weights {w}: {rows[w]}", flush=True)
    return {"baseline": base, "prompts": WEIGHT_PROMPTS, "answer_tokens": WEIGHT_ANSWER_TOKENS, "by_weights": rows}


# -- transformers -----------------------------------------------------------------------------------


def bf16_decode_weights(engine: LLMEngine) -> bool:
    """Whether the engine's model decodes on bfloat16 copies of its float32 weights."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "the engine bench runs a model, not the sim runner"
    return runner.bf16_decode_weights


def load_transformers(engine: LLMEngine):
    import transformers

    from kvroute.model_source import resolve_model

    source = resolve_model(engine.config.model)
    if source.path is None:
        raise ValueError(f"model {engine.config.model!r}: transformers needs a GGUF file or an HF directory")
    if source.kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_prefill_seconds(hf, prompt: list[int]) -> float:
    start = time.perf_counter()
    hf(input_ids=torch.tensor([prompt]), logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_generate_seconds(hf, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return time.perf_counter() - start


# -- the run ----------------------------------------------------------------------------------------


def run(
    model: str,
    repeats: int,
    sections: tuple[str, ...] = SECTIONS,
    dtype_name: str = "auto",
    weights: list[str] | None = None,
) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype_name))
    same = engine.dtype == torch.float32 and not bf16_decode_weights(engine)  # plain float32 already
    fp32 = engine if same else LLMEngine(EngineConfig(model=model, dtype="float32"))
    corpus = Corpus(fp32.tokenizer.encode(real_text()))
    print(f"corpus: {len(corpus.ids)} tokens; fp32 engine {fp32.runner.num_kv_blocks} KV blocks", flush=True)
    dtype = str(engine.dtype).removeprefix("torch.") + ("+bf16 decode" if bf16_decode_weights(engine) else "")
    report: dict = {
        "model": fp32.model_id,
        "cpu": cpu_description(),
        "dtype": dtype,
        "dtype_reason": engine.dtype_reason,
        "attention_backend": engine.attention_backend,
        "attention_backend_fp32": fp32.attention_backend,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
    }
    print(f"cpu: {report['cpu']}\ndtype: {engine.dtype_reason}; attention: {engine.attention_backend}", flush=True)
    hf = load_transformers(fp32) if {"prefill", "decode_b1", "throughput"} & set(sections) else None

    def interleaved(
        kvroute: Callable[[LLMEngine], float], transformers: Callable[[], float], work: float, transformers_key: str
    ) -> dict[str, float]:
        """Rates (`work` per median second) of this engine, the float32 one (unless the same) and transformers,
        run in turn, and the engine's ratio to transformers."""
        runs = {"kvroute": lambda: kvroute(engine), "kvroute_fp32": lambda: kvroute(fp32), "transformers": transformers}
        if same:
            del runs["kvroute_fp32"]
        seconds = interleaved_medians(runs, repeats)
        seconds.setdefault("kvroute_fp32", seconds["kvroute"])
        row = {
            "kvroute_tok_s": work / seconds["kvroute"],
            "kvroute_fp32_tok_s": work / seconds["kvroute_fp32"],
            transformers_key: work / seconds["transformers"],
        }
        row["ratio"] = row["kvroute_tok_s"] / row[transformers_key]
        return row

    def fresh_ttft(engine: LLMEngine, n: int) -> float:
        return ttft(engine, corpus.take(n))[0]

    def hf_fresh_prefill(n: int) -> float:
        return hf_prefill_seconds(hf, corpus.take(n))

    if "prefill" in sections:
        prefill: dict = {}
        for n in (1000, 3000):
            row = interleaved(
                functools.partial(fresh_ttft, n=n),
                functools.partial(hf_fresh_prefill, n),
                n,
                "transformers_fp32_tok_s",
            )
            prefill[str(n)] = row
            print(f"prefill {n}: {row}", flush=True)
        report["prefill"] = prefill

    if "prefix_ttft" in sections:
        report["prefix_ttft"] = prefix_ttft(engine, corpus, repeats)
        report["prefix_ttft_fp32"] = report["prefix_ttft"] if same else prefix_ttft(fp32, corpus, repeats)
        print(f"prefix ttft: {dtype} {report['prefix_ttft']} fp32 {report['prefix_ttft_fp32']}", flush=True)

    if "decode_b1" in sections:
        short = corpus.take(20)
        decode = interleaved(
            functools.partial(decode_seconds, prompt=short),
            lambda: (
                (hf_generate_seconds(hf, [short], OUTPUT_TOKENS) - hf_generate_seconds(hf, [short], 1))
                / (OUTPUT_TOKENS - 1)
            ),
            1,
            "transformers_tok_s",
        )
        decode["ratio_fp32"] = decode["kvroute_fp32_tok_s"] / decode["transformers_tok_s"]
        report["decode_b1"] = decode
        print(f"decode b1: {decode}", flush=True)

    if "throughput" in sections:
        tokens = THROUGHPUT_REQUESTS * OUTPUT_TOKENS

        def prompts() -> list[list[int]]:  # fresh ones every run: none is cached from an earlier one
            return [corpus.take(THROUGHPUT_PROMPT + i % 16) for i in range(THROUGHPUT_REQUESTS)]

        throughput = interleaved(
            lambda e: tokens / kvroute_throughput(e, prompts()),
            lambda: hf_generate_seconds(hf, prompts(), OUTPUT_TOKENS),
            tokens,
            "transformers_tok_s",
        )
        throughput["ratio_fp32"] = throughput["kvroute_fp32_tok_s"] / throughput["transformers_tok_s"]
        report["throughput"] = throughput
        print(f"throughput: {throughput}", flush=True)

    if "bf16_quality" in sections and engine.dtype == torch.bfloat16:
        report["bf16_quality"] = bf16_quality(fp32, engine, [corpus.take(200) for _ in range(3)])
    if weights:
        report["weights"] = weights_section(model, weights, dtype_name, corpus, repeats)
    return report


def print_table(report: dict) -> None:
    dtype = report["dtype"]
    print(f"{report['model']} on {report['cpu']}, {report['threads']} threads, medians of {report['repeats']}")
    print(f"dtype {report['dtype_reason']}; attention {report['attention_backend']}")
    rows = []
    if p := report.get("prefix_ttft"):
        p32 = report["prefix_ttft_fp32"]
        rows.append(
            (
                f"prefix TTFT {dtype} | fp32 (3300 tok, 2900 cached)",
                f"{p['uncached_ms']:.0f} -> {p['cached_ms']:.0f} ms | "
                f"{p32['uncached_ms']:.0f} -> {p32['cached_ms']:.0f} ms",
                f"{p['speedup']:.2f}x | {p32['speedup']:.2f}x",
            )
        )
    if t := report.get("throughput"):
        rows.append(
            (
                f"throughput 32x(200+64) tok/s {dtype} | fp32 vs HF",
                f"{t['kvroute_tok_s']:.1f} | {t['kvroute_fp32_tok_s']:.1f} vs {t['transformers_tok_s']:.1f}",
                f"{t['ratio']:.2f}x | {t['ratio_fp32']:.2f}x",
            )
        )
    if d := report.get("decode_b1"):
        rows.append(
            (
                f"decode b1 tok/s {dtype} | fp32 vs HF",
                f"{d['kvroute_tok_s']:.1f} | {d['kvroute_fp32_tok_s']:.1f} vs {d['transformers_tok_s']:.1f}",
                f"{d['kvroute_tok_s'] / d['transformers_tok_s']:.2f}x | "
                f"{d['kvroute_fp32_tok_s'] / d['transformers_tok_s']:.2f}x",
            )
        )
    for n, row in report.get("prefill", {}).items():
        rows.append(
            (
                f"prefill {n} tok/s {dtype} | fp32 vs HF fp32",
                f"{row['kvroute_tok_s']:.0f} | {row['kvroute_fp32_tok_s']:.0f} vs {row['transformers_fp32_tok_s']:.0f}",
                f"{row['ratio']:.2f}x",
            )
        )
    if q := report.get("bf16_quality"):
        rows.append(
            (
                f"{dtype} vs fp32 (positions)",
                f"top-1 {q['top1_agreement']:.3f}, KL {q['mean_kl']:.4f}",
                str(q["positions"]),
            )
        )
    if w := report.get("weights"):
        for name, row in w["by_weights"].items():
            rows.append(
                (
                    f"weights {name} ({row['dtype']}): decode b1 tok/s, MiB",
                    f"{row['decode_tok_s']:.1f} tok/s, {row['model_mib']:.0f} MiB "
                    f"({row['bytes_vs_float32']:.2f}x float32), greedy {row['greedy_identical']}/{w['prompts']} same",
                    f"{row['decode_ratio']:.2f}x {w['baseline']}",
                )
            )
    width = max((len(r[0]) for r in rows), default=0)
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:<40}  {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="kvroute's engine")
    parser.add_argument(
        "--weights",
        help=f"compare these --weights values ({','.join(WEIGHTS)}), the first the baseline, e.g. float,int8,int4",
    )
    args = parser.parse_args()
    weights = args.weights.split(",") if args.weights else None
    if weights and (unknown_weights := set(weights) - set(WEIGHTS)):
        parser.error(f"--weights: unknown {', '.join(sorted(unknown_weights))}; choose from {', '.join(WEIGHTS)}")
    default_sections = "" if weights and args.sections == ",".join(SECTIONS) else args.sections
    sections = tuple(filter(None, default_sections.split(",")))
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(args.threads)
    report = run(args.model, args.repeats, sections, args.dtype, weights)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
