"""What detokenizing a stream costs per worker message: the byte-level table lookups (`ByteLevelDetokenizer`,
what `Tokenizer.incremental_detokenizer` gives for SmolLM2's tokenizer, the `sim` model's) against the library's
`DecodeStream` (`StreamDetokenizer`, the path of every other decoder), in one process, taking turns.

    python -m benchmarks.detokenizer_bench [--rounds 5] [--repeats 200] [--json OUT]

A stream is 200 tokens of text (English with accents, CJK and emoji, so characters split across tokens and
messages) fed in messages of N tokens (1, and 20: what a zero-cost sim worker sends per message under
gateway_bench's streams), then flushed; each case is the median CPU time of a whole stream over `--repeats`
streams, per message; ratios are stream / table, medians over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.cpu_time import median_cpu_us
from kvroute.model_source import resolve_model
from kvroute.tokenizer import ByteLevelDetokenizer, StreamDetokenizer, Tokenizer

TEXT = "The café's crème brûlée costs 12 € — 日本語のテキスト 🎉🤖 and the quick brown fox jumps over the dog. "
STREAM_TOKENS = 200
MESSAGE_TOKENS = (1, 20)


def stream_of(tokenizer: Tokenizer) -> list[int]:
    ids: list[int] = []
    while len(ids) < STREAM_TOKENS:
        ids += tokenizer.encode(TEXT)
    return ids[:STREAM_TOKENS]


def detokenize(make: Callable[[], StreamDetokenizer | ByteLevelDetokenizer], messages: list[list[int]]) -> str:
    detokenizer = make()
    return "".join(detokenizer.add(m) for m in messages) + detokenizer.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    tokenizer = Tokenizer.for_model(resolve_model("sim"))
    ids = stream_of(tokenizer)
    makers: dict[str, Callable[[], StreamDetokenizer | ByteLevelDetokenizer]] = {
        "table": lambda: tokenizer.incremental_detokenizer(),
        "stream": lambda: StreamDetokenizer(tokenizer),
    }
    texts = set()
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for size in MESSAGE_TOKENS:
            messages = [ids[i : i + size] for i in range(0, len(ids), size)]
            for name, make in makers.items():
                stream = functools.partial(detokenize, make, messages)
                texts.add(stream())
                us = median_cpu_us(stream, args.repeats) / len(messages)
                rows.setdefault(f"{name}_{size}", []).append(us)
    if len(texts) != 1:
        raise SystemExit("the two detokenizers gave different texts")

    result: dict[str, float] = {key: statistics.median(values) for key, values in rows.items()}
    for size in MESSAGE_TOKENS:
        ratios = [s / t for s, t in zip(rows[f"stream_{size}"], rows[f"table_{size}"], strict=True)]
        result[f"ratio_{size}"] = statistics.median(ratios)
        print(
            f"{size:>3} tokens per message: DecodeStream {result[f'stream_{size}']:6.2f} CPU-µs, "
            f"table {result[f'table_{size}']:5.2f} CPU-µs per message, stream / table {result[f'ratio_{size}']:.2f}x"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
