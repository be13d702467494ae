"""`kvroute doctor FILE.jsonl`: where each app's prompts stop sharing their prefix, and what that costs.

The first thing to check when a prefix-cache hit rate drops: a request ID, a date or a user name early in
a template ends the shared prefix there, and everything after it is recomputed on every request, even
the parts that are the same for all of them.

Input, one request a line (JSON), in arrival order:
  * rendered prompts: {"app": "support", "prompt": "..."} or {"app": "support", "messages": [...]}
    (chat messages, rendered through the model's chat template), with an optional "timestamp" (ms);
  * or a Mooncake trace ({"timestamp", "input_length", "output_length", "hash_ids"}), read as one app.

Per app, with one unlimited prefix cache over the app's requests in file order (the replay's ideal):
  * hit rate: the share of prompt tokens that cache serves (full blocks; the last token is computed);
  * could have: the hit rate if the content that a request shares with its best-matching earlier request
    (runs of at least one block found after the point where their prefixes part) came first;
  * stops sharing at: the line number and token position in the rendered prompt where most requests
    that lose such shared content part from their best match, with that line's first characters;
  * wasted: prefill tokens per day that the difference costs at the file's request rate (the span of
    its timestamps), or in total when the file has none.
Apps are ranked by waste. A Mooncake trace has no text: its hit rate and where its prompts part (in
512-token blocks) are reported; what comes after a parting cannot be compared from prefix-chained ids.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path

from kvroute.errors import UserError
from kvroute.hashing import DEFAULT_BLOCK_SIZE, block_hashes
from kvroute.prefix import common_prefix_length
from sim.traces import MOONCAKE_BLOCK_TOKENS, TraceError, json_object_line, read_mooncake

DOCTOR_MODEL_ID = "doctor"
LINE_EXCERPT = 48  # characters of the parting line shown
ALIGN_SAMPLE = 400  # requests per app whose tails are aligned (every k-th); the rest are scaled from them


class DoctorError(ValueError):
    """A file the doctor cannot read; the message names the line and the field."""


@dataclass
class Prompt:
    app: str
    line: int  # line of the input file
    timestamp_ms: float | None
    token_ids: Sequence[int]  # for a Mooncake trace: its hash ids (one per 512-token block)
    num_tokens: int
    text: str | None = None  # the rendered prompt (None for a Mooncake trace)
    offsets: Sequence[tuple[int, int]] | None = None  # each token's character span in `text`


@dataclass(frozen=True)
class Parting:
    """Where an app's prompts stop sharing their prefix (most often)."""

    token: int  # token position in the rendered prompt (the first token not shared)
    line: int | None  # line number in the rendered prompt (None for a Mooncake trace)
    excerpt: str  # the start of that line
    requests: int  # requests that part there and lose shared content after it

    def describe(self) -> str:
        if self.line is None:
            return f"token {self.token:,} (block {self.token // MOONCAKE_BLOCK_TOKENS})"
        return f"line {self.line}, token {self.token:,}: {self.excerpt!r}"


@dataclass
class AppReport:
    app: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    possible_cached_tokens: int
    parting: Parting | None
    wasted_per_day: float | None = None  # None when the file has no time span
    parting_histogram: dict[int, int] = field(default_factory=dict, repr=False)  # token position -> requests

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def possible_hit_rate(self) -> float:
        return self.possible_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def wasted_tokens(self) -> int:
        return self.possible_cached_tokens - self.cached_tokens

    def to_json(self) -> dict:
        return {
            "app": self.app,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "possible_hit_rate": round(self.possible_hit_rate, 6),
            "wasted_prefill_tokens": self.wasted_tokens,
            "wasted_prefill_tokens_per_day": None if self.wasted_per_day is None else round(self.wasted_per_day),
            "stops_sharing_at": None
            if self.parting is None
            else {
                "token": self.parting.token,
                "line": self.parting.line,
                "excerpt": self.parting.excerpt,
                "requests": self.parting.requests,
            },
        }


@dataclass
class DoctorReport:
    file: str
    kind: str  # "prompts" or "mooncake"
    requests: int
    span_s: float | None
    block_size: int
    apps: list[AppReport]  # ranked by waste, then by prompt tokens

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "kind": self.kind,
            "requests": self.requests,
            "span_s": self.span_s,
            "block_size": self.block_size,
            "apps": [a.to_json() for a in self.apps],
        }


# -- reading --------------------------------------------------------------------------------------


def read_prompts(path: Path, tokenizer) -> list[Prompt]:
    """Rendered prompts from `path`, tokenized (chat messages through `tokenizer.apply_chat_template`)."""
    records = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    records.append((number, _parse_prompt_line(line, number)))
    except (OSError, UnicodeDecodeError) as exc:
        raise DoctorError(f"{path}: cannot read: {exc}") from exc
    if not records:
        raise DoctorError(f"{path}: no requests")
    texts = []
    for number, (_, messages, prompt, _) in records:
        if messages is None:
            texts.append(prompt)
            continue
        try:
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except ValueError as exc:
            raise DoctorError(f"line {number}: field 'messages': {exc}") from None
    encodings = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    return [
        Prompt(app, number, ts, enc.ids, len(enc.ids), text, enc.offsets)
        for (number, (app, _, _, ts)), text, enc in zip(records, texts, encodings, strict=True)
    ]


def _parse_prompt_line(line: str, number: int) -> tuple[str, list | None, str | None, float | None]:
    record = json_object_line(line, number, DoctorError)
    app = record.get("app")
    if not isinstance(app, str) or not app:
        raise DoctorError(f"line {number}: field 'app' must be a non-empty string")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise DoctorError(f"line {number}: give exactly one of the fields 'prompt' and 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise DoctorError(f"line {number}: field 'prompt' must be a string")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise DoctorError(f"line {number}: field 'messages' must be a non-empty list of {{role, content}} objects")
    timestamp = record.get("timestamp")
    if timestamp is not None and (
        isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp)
    ):
        raise DoctorError(f"line {number}: field 'timestamp' must be a number (ms)")
    return app, messages, prompt, None if timestamp is None else float(timestamp)


def read_mooncake_prompts(path: Path) -> list[Prompt]:
    trace = read_mooncake(path)
    return [Prompt("trace", i + 1, r.arrival_ms, r.hash_ids, r.input_length) for i, r in enumerate(trace.requests)]


def _is_mooncake(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as lines:
            first = next((line for line in lines if line.strip()), "")
        return isinstance(record := json.loads(first), dict) and "hash_ids" in record
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


# -- the diagnosis --------------------------------------------------------------------------------


def diagnose(prompts: Sequence[Prompt], block_size: int, mooncake: bool = False) -> list[AppReport]:
    """One report per app, ranked by wasted prefill tokens (then by prompt tokens)."""
    by_app: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        by_app[p.app].append(p)
    span_s = _span_s(prompts)
    reports = [_diagnose_app(app, ps, block_size, mooncake) for app, ps in by_app.items()]
    if span_s:
        for r in reports:
            r.wasted_per_day = r.wasted_tokens * 86_400 / span_s
    return sorted(reports, key=lambda r: (-r.wasted_tokens, -r.prompt_tokens, r.app))


def _span_s(prompts: Sequence[Prompt]) -> float | None:
    stamps = [p.timestamp_ms for p in prompts if p.timestamp_ms is not None]
    if len(stamps) < 2 or max(stamps) <= min(stamps):
        return None
    return (max(stamps) - min(stamps)) / 1000


def _diagnose_app(app: str, prompts: Sequence[Prompt], block_size: int, mooncake: bool) -> AppReport:
    block = MOONCAKE_BLOCK_TOKENS if mooncake else block_size
    holder: dict = {}  # block key -> index of the first request that had it (the unlimited cache)
    cached = possible = 0
    stride = max(1, math.ceil(len(prompts) / ALIGN_SAMPLE))
    partings: Counter[tuple[int, int | None]] = Counter()  # (token, line) -> requests losing content after it
    histogram: Counter[int] = Counter()
    recovered_sampled = aligned = candidates = 0
    for i, p in enumerate(prompts):
        keys = list(p.token_ids) if mooncake else block_hashes(p.token_ids, model_id=DOCTOR_MODEL_ID, block_size=block)
        usable = len(keys) if mooncake else (p.num_tokens - 1) // block
        depth = 0
        while depth < len(keys) and keys[depth] in holder:
            depth += 1
        reference = prompts[holder[keys[depth - 1]]] if depth else (prompts[i - 1] if i else None)
        cached += min(min(depth, usable) * block, p.num_tokens)
        for key in keys:
            holder.setdefault(key, i)
        if reference is None:
            continue
        if mooncake:
            histogram[depth * block] += 1
            continue
        parted = common_prefix_length(p.token_ids, reference.token_ids)
        histogram[parted] += 1
        if parted >= p.num_tokens - 1:
            continue
        candidates += 1
        if i % stride:
            continue
        aligned += 1
        shared_after = _shared_after(p.token_ids, reference.token_ids, parted, block)
        recovered = min(((parted + shared_after) // block) * block, usable * block) - min(depth, usable) * block
        if recovered > 0:
            recovered_sampled += recovered
            partings[(parted, _line_of(p, parted))] += 1
    if aligned:
        possible = cached + round(recovered_sampled * candidates / aligned)
    else:
        possible = cached
    return AppReport(
        app=app,
        requests=len(prompts),
        prompt_tokens=sum(p.num_tokens for p in prompts),
        cached_tokens=cached,
        possible_cached_tokens=possible,
        parting=_main_parting(partings, prompts, mooncake, histogram),
        parting_histogram=dict(sorted(histogram.items())),
    )


def _shared_after(a: Sequence[int], b: Sequence[int], start: int, block: int) -> int:
    """Tokens of `a` after `start` found in `b` after `start` in runs of at least one block."""
    matcher = SequenceMatcher(None, a[start:], b[start:], autojunk=False)
    return sum(m.size for m in matcher.get_matching_blocks() if m.size >= block)


def _line_of(p: Prompt, token: int) -> int | None:
    if p.text is None or p.offsets is None or token >= len(p.offsets):
        return None
    return p.text.count("\n", 0, p.offsets[token][0]) + 1


def _main_parting(
    partings: Counter[tuple[int, int | None]], prompts: Sequence[Prompt], mooncake: bool, histogram: Counter[int]
) -> Parting | None:
    if mooncake:
        if not histogram:
            return None
        token, count = max(histogram.items(), key=lambda kv: (kv[1], -kv[0]))
        return Parting(token, None, "", count)
    if not partings:
        return None
    by_line: Counter[int | None] = Counter()
    for (_, line), count in partings.items():
        by_line[line] += count
    line, count = by_line.most_common(1)[0]
    tokens = [t for (t, ln), c in partings.items() if ln == line for _ in range(c)]
    token = int(statistics.median_low(tokens))
    excerpt = ""
    for p in prompts:
        if p.text is not None and line is not None:
            excerpt = p.text.split("\n")[line - 1][:LINE_EXCERPT]
            break
    return Parting(token, line, excerpt, count)


def run_doctor(path: Path, tokenizer_factory, block_size: int = DEFAULT_BLOCK_SIZE) -> DoctorReport:
    """Read and diagnose `path`; `tokenizer_factory()` is called only for rendered prompts."""
    if not path.is_file():
        raise DoctorError(f"{path}: no such file")
    if _is_mooncake(path):
        try:
            prompts = read_mooncake_prompts(path)
        except TraceError as exc:
            raise DoctorError(str(exc)) from None
        kind = "mooncake"
    else:
        prompts = read_prompts(path, tokenizer_factory())
        kind = "prompts"
    apps = diagnose(prompts, block_size, mooncake=kind == "mooncake")
    return DoctorReport(str(path), kind, len(prompts), _span_s(prompts), block_size, apps)


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.jsonl", type=Path, help="rendered prompts or a Mooncake trace")
    parser.add_argument("--model", default="smollm2", help="tokenizer and chat template (default smollm2)")
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=f"KV block size (default {DEFAULT_BLOCK_SIZE})"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")

    def tokenizer():
        from kvroute.model_source import resolve_model
        from kvroute.tokenizer import Tokenizer

        try:
            return Tokenizer.for_model(resolve_model(args.model))
        except (ValueError, FileNotFoundError) as exc:
            raise UserError(f"--model: {exc}") from None

    try:
        report = run_doctor(args.file, tokenizer, args.block_size)
    except DoctorError as exc:
        raise UserError(str(exc)) from None
    print(format_report(report))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 0


def format_report(report: DoctorReport) -> str:
    per_day = report.span_s is not None
    header = ["app", "requests", "prompt tokens", "hit rate", "could have", "wasted prefill tokens"]
    header.append("per day" if per_day else "(no timestamps: in the file)")
    header.append("stops sharing at")
    rows = []
    for a in report.apps:
        rows.append(
            [
                a.app,
                f"{a.requests:,}",
                f"{a.prompt_tokens:,}",
                f"{100 * a.hit_rate:.1f}%",
                f"{100 * a.possible_hit_rate:.1f}%",
                f"{a.wasted_tokens:,}",
                f"{a.wasted_per_day:,.0f}" if a.wasted_per_day is not None else "",
                a.parting.describe() if a.parting else "-",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    span = f", {report.span_s:,.0f} s of traffic" if report.span_s else ""
    lines = [f"{report.file}: {report.requests:,} requests, {len(report.apps)} app(s){span}; ranked by waste"]
    for row in [header, *rows]:
        cells = [
            c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
