"""A prompts file for `kvroute doctor`: three apps, one with the seeds' support-assistant mistake.

`python -m sim.doctor_example OUT.jsonl [--requests N] [--seed S]` writes N requests over one hour:
  * support (text prompts): "You are the support assistant for Acme." then the request ID on line 2,
    then about 2,000 tokens of the same policies for everyone, then the customer's question;
  * rag (chat messages): a fixed system prompt, then a user message that opens with the current date and
    time, then the same 1,000-token knowledge-base extract, then the question;
  * faq (chat messages): a fixed system prompt and the question last (nothing to fix).
Text is drawn from a small word list with a seeded generator, so the file is reproducible.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "account refund order shipping invoice policy customer warranty return delivery payment card address "
    "support ticket escalate agent product service replace damaged missing late subscription cancel plan "
    "upgrade discount coupon billing tax region store pickup tracking carrier label exchange credit"
).split()
SPAN_MS = 3_600_000


def _text(rng: random.Random, words: int) -> str:
    lines = []
    while words > 0:
        n = min(words, rng.randint(8, 16))
        lines.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        words -= n
    return "\n".join(lines)


def example_requests(requests: int = 300, seed: int = 0) -> list[dict]:
    """The file's records, in arrival order (apps interleaved; support 50%, rag 30%, faq 20%)."""
    rng = random.Random(seed)
    support_policies = _text(rng, 1500)
    rag_system, kb = _text(rng, 200), _text(rng, 750)
    faq_system = _text(rng, 900)
    stamps = sorted(rng.uniform(0, SPAN_MS) for _ in range(requests))
    out = []
    for i, ts in enumerate(stamps):
        question = _text(rng, rng.randint(20, 60))
        app = rng.choices(("support", "rag", "faq"), (5, 3, 2))[0]
        if app == "support":
            request_id = "".join(rng.choice("0123456789abcdef") for _ in range(32))
            prompt = (
                "You are the support assistant for Acme.\n"
                f"Request ID: {request_id}\n{support_policies}\nCustomer: {question}\nAssistant:"
            )
            out.append({"app": app, "timestamp": round(ts, 3), "prompt": prompt})
        elif app == "rag":
            now = f"{1 + i * 28 // requests:02d} Nov 2026, {ts / 60_000 % 60:05.2f} min"
            user = f"Today is {now}.\nKnowledge base:\n{kb}\nQuestion: {question}"
            messages = [{"role": "system", "content": rag_system}, {"role": "user", "content": user}]
            out.append({"app": app, "timestamp": round(ts, 3), "messages": messages})
        else:
            messages = [{"role": "system", "content": faq_system}, {"role": "user", "content": question}]
            out.append({"app": app, "timestamp": round(ts, 3), "messages": messages})
    return out


def write_example(path: Path, requests: int = 300, seed: int = 0) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in example_requests(requests, seed)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_example(args.out, args.requests, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
