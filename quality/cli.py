"""`kvroute quality`: judge a candidate configuration against a reference on the same engine and model, by a
decision rule written before the run. Exit 0: the rule holds; 1: it does not; 2: bad arguments; 3: refused, the
two sides' chat templates render some prompt differently. The protocol: quality/protocol.py and
docs/quantization.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvroute.errors import UserError
from kvroute.sampling import InvalidRequest
from quality.config_spec import SPEC_KEYS, parse_config_spec
from quality.decision_rule import LONG_METRICS, METRICS, parse_rule
from quality.prompts import BUILTIN, load_prompts
from quality.protocol import Settings, Side, compare
from quality.report import json_report, text_report
from quality.template_check import TemplateMismatch

EXIT_PASS, EXIT_FAIL, EXIT_REFUSED = 0, 1, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    spec_help = f"comma-separated key=value ({', '.join(SPEC_KEYS)}=FILE)"
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | a .gguf file | an HF directory")
    parser.add_argument("--reference", default="weights=float", help=f"the reference configuration: {spec_help}")
    parser.add_argument("--candidate", required=True, help=f"the configuration judged: {spec_help}")
    parser.add_argument(
        "--prompts",
        default=BUILTIN,
        help='builtin (200 chat prompts) or a JSONL file of {"messages": [...]} or {"prompt": "..."}',
    )
    parser.add_argument("--limit", type=int, help="only the first N prompts (builtin: the long-form ones kept)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each greedy answer's limit (default 64)")
    parser.add_argument(
        "--long-prompts", type=int, default=16, help="prompts answered long for the drift measure (default 16; 0: none)"
    )
    parser.add_argument("--long-tokens", type=int, default=512, help="each long answer's length (default 512)")
    rule = parser.add_mutually_exclusive_group(required=True)
    rule.add_argument(
        "--accept", help=f"the decision rule, e.g. 'flips_above_floor<=0.02,top1>=0.97'; metrics: {', '.join(METRICS)}"
    )
    rule.add_argument("--accept-file", type=Path, help="the decision rule in a file: clauses by commas or lines")
    parser.add_argument("--json", type=Path, help="write everything measured here")
    parser.add_argument("--plot", type=Path, help="write a PNG here (agreement and KL by position, flips)")


def run(args: argparse.Namespace) -> int:
    if args.accept_file is not None:
        try:
            rule = parse_rule(args.accept_file.read_text(), f"--accept-file {str(args.accept_file)!r}")
        except OSError as exc:
            raise UserError(f"--accept-file {str(args.accept_file)!r}: {exc.strerror or exc}") from exc
    else:
        rule = parse_rule(args.accept)
    for name in ("max_tokens", "long_tokens", "long_prompts"):
        if getattr(args, name) < (1 if name == "max_tokens" else 0):
            raise UserError(f"--{name.replace('_', '-')} must be >= {1 if name == 'max_tokens' else 0}")
    long_wanted = args.long_prompts > 0 and args.long_tokens > 0
    if not long_wanted and rule.metrics & LONG_METRICS:
        raise UserError(f"the rule reads {', '.join(sorted(rule.metrics & LONG_METRICS))}, but no long outputs run")
    reference = parse_config_spec(args.reference, "--reference")
    candidate = parse_config_spec(args.candidate, "--candidate")
    prompt_set = load_prompts(args.prompts, args.long_prompts if long_wanted else 0)
    if args.limit is not None:
        if args.limit < 1:
            raise UserError("--limit must be >= 1")
        prompt_set = prompt_set.first(args.limit)
    try:
        comparison = compare(
            Side(reference.engine_config(args.model), reference.chat_template, reference.text),
            Side(candidate.engine_config(args.model), candidate.chat_template, candidate.text),
            prompt_set,
            Settings(args.max_tokens, args.long_tokens if long_wanted else 0, progress=True),
        )
    except TemplateMismatch as exc:
        print(f"kvroute quality: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (InvalidRequest, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    verdict = rule.judge(comparison.metrics())
    print(text_report(comparison, rule, verdict, args.prompts))
    if args.json is not None:
        args.json.write_text(json.dumps(json_report(comparison, rule, verdict, args.prompts), indent=1) + "\n")
    if args.plot is not None:
        from quality.plot import plot_comparison

        plot_comparison(comparison, args.plot)
    return EXIT_PASS if verdict.passed else EXIT_FAIL
