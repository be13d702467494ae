"""What the chat template and the tokenizer cost per prompt, with and without the tokenizer's memory of text runs
(`Tokenizer.encode_chat(cache_scope=...)`), against another checkout's tokenizer in the same run.

    python -m benchmarks.tokenizer_cache_bench [--baseline-tree DIR] [--rounds 5] [--repeats 200] [--json OUT]

Cases (SmolLM2's tokenizer, the `sim` model's), each `encode_chat`'s median CPU time over `--repeats` calls:
- `bench_chat`: gateway_bench's request (a 480-character system prompt shared by every request, a new user
  question each time), the scope warm;
- `long_cold`: a 4,093-token system prompt, nothing remembered (no scope);
- `long_system_seen`: the same with its system prompt remembered, a new user question each time;
- `conversation_new_turn`: a 4,000-token conversation of 48 short turns (each under 256 characters), its
  earlier turns remembered (the previous request of the same conversation), a new user turn each time;
- the floor: `tokenizers`' own `encode_batch_fast` of the long prompt's rendered text (special tokens parsed out
  of the text, which the gateway must never do with client text).
With `--baseline-tree DIR` each round runs this file's cases in a child process whose `kvroute` is imported from
DIR, the two trees in turn (drift on a shared machine hits both alike); ratios are this tree's / DIR's, medians
over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM = "You are a concise assistant for a bicycle shop. Answer in one short sentence. " * 6
WORDS = "The quick brown fox jumps over the lazy dog near the river bank. "


def measure(repeats: int) -> dict[str, float]:
    """Each case's median CPU-µs per call, in this process, with the `kvroute` on sys.path."""
    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer

    tokenizer = Tokenizer.for_model(resolve_model("sim"))
    counter = iter(range(10**9))

    def median_us(fn: Callable[[], object]) -> float:
        # Not benchmarks.cpu_time's: this function also runs under another tree's sys.path (`measure_tree`),
        # so it imports nothing of this checkout's but kvroute.
        times = []
        for _ in range(repeats):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return statistics.median(times) * 1e6

    def question() -> dict[str, str]:
        return {"role": "user", "content": f"Question {next(counter)}: do you fix brakes?"}

    def chat(system: str, scope: str | None) -> Callable[[], object]:
        return lambda: tokenizer.encode_chat([{"role": "system", "content": system}, question()], cache_scope=scope)

    system = WORDS * 290  # ~4,090 tokens with the template's markup
    turns = [{"role": "system", "content": "You help with bicycles. " * 4}]
    for k in range(48):
        turns.append({"role": "user", "content": f"Turn {k}: " + WORDS * 2})
        turns.append({"role": "assistant", "content": f"Answer {k}: " + WORDS * 2})

    def conversation() -> list[int]:
        return tokenizer.encode_chat([*turns, question()], cache_scope="tenant")

    rendered = tokenizer.apply_chat_template([{"role": "system", "content": system}, question()])
    chat(SYSTEM, "tenant")()
    chat(system, "tenant")()
    conversation()
    return {
        "bench_chat": median_us(chat(SYSTEM, "tenant")),
        "long_cold": median_us(chat(system, None)),
        "long_system_seen": median_us(chat(system, "tenant")),
        "conversation_new_turn": median_us(conversation),
        "floor_encode_batch_fast": median_us(lambda: tokenizer.backend.encode_batch_fast([rendered])),
        "long_prompt_tokens": len(tokenizer.encode_chat([{"role": "system", "content": system}, question()])),
        "conversation_tokens": len(conversation()),
    }


def measure_tree(tree: str, repeats: int) -> dict[str, float]:
    """`measure` in a child process that imports kvroute from `tree`."""
    code = (
        f"import sys, json, runpy; sys.path.insert(0, {tree!r}); "
        f"print(json.dumps(runpy.run_path({__file__!r})['measure']({repeats})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tokenizer_cache_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--baseline-tree", default=None, help="also measure the tokenizer of this checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this": here} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(measure_tree(tree, args.repeats))
    result: dict[str, Any] = {
        name: {case: statistics.median(r[case] for r in runs) for case in runs[0]} for name, runs in rounds.items()
    }
    if "baseline" in rounds:
        result["ratio_this_over_baseline"] = {
            case: statistics.median(a[case] / b[case] for a, b in zip(rounds["this"], rounds["baseline"], strict=True))
            for case in rounds["this"][0]
            if not case.endswith("_tokens")
        }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"encode_chat, CPU-µs per call, medians of {args.rounds} rounds x {args.repeats} calls")
    names = list(trees)
    print(f"  {'case':<26}" + "".join(f"{n:>12}" for n in names) + ("  this/baseline" if len(names) > 1 else ""))
    for case in result["this"]:
        cells = "".join(f"{result[n][case]:12.0f}" for n in names)
        ratio = result.get("ratio_this_over_baseline", {}).get(case)
        print(f"  {case:<26}{cells}" + (f"  {ratio:.2f}x" if ratio is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
