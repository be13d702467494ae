"""`kvroute bench`: the command line of the live load generator (loadtest.bench, the library). It sends a
rendered workload to a live OpenAI-compatible endpoint (`--url`: a kvroute gateway, one worker's own HTTP
port, or another router) and reports the latencies users feel; `--compare` runs one fresh fleet per entry
instead (loadtest.compare), `--faults` a soak through worker kills and Redis and gateway restarts
(loadtest.soak).

Arrivals: `--rate R` is open-loop Poisson at R requests/s (seeded); `--concurrency C` keeps C requests in
flight; neither replays the workload's own timestamps. Sessions are closed-loop by default (`--history
live`). `--requests N` takes the workload's first N requests; `--duration S` stops sending after S seconds.
`--api responses` sends through `/v1/responses`, a conversation's later turns by `previous_response_id`
(loadtest.bench).

A traffic mix (loadtest.traffic_mix): `--tenants` deals the conversations over tenants (fleets started here get
an API key each), `--bands` the requests over priority bands, `--band-slo` sets a band's objectives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvroute.errors import UserError
from loadtest.bench import (
    APIS,
    DEFAULT_TIMEOUT_S,
    Arrivals,
    GrpcSender,
    HttpSender,
    Sender,
    Target,
    bench_json,
    run_requests,
    served_model,
)
from loadtest.bench_stats import SLO, Objectives, format_summary, summarize
from loadtest.compare import add_compare_arguments, run_compare
from loadtest.render import CHAT_THINK_MS, RenderError, Workload, dump_jsonl, render, workload_names
from loadtest.soak import run_soak
from loadtest.traffic_mix import TrafficMix, parse_band_slos, parse_bands, parse_tenants
from sim.traces import MOONCAKE_BLOCK_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (with --grpc: HOST:PORT)"
    )
    parser.add_argument("--workload", default="chat", help=f"workload (default chat): {', '.join(workload_names())}")
    arrivals = parser.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None, help="open-loop Poisson arrivals, requests/s")
    arrivals.add_argument("--concurrency", type=int, default=None, help="keep this many requests in flight")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="without --rate/--concurrency: multiply the timestamps"
    )
    parser.add_argument("--requests", type=int, default=None, help="send the workload's first N requests")
    parser.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    parser.add_argument(
        "--grpc", action="store_true", help="send through the gateway's gRPC front door; --url is then HOST:PORT"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT objective, ms")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT objective, ms")
    parser.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput: end-to-end objective, ms")
    parser.add_argument(
        "--tenants",
        default=None,
        metavar="NAME:SHARE[:WEIGHT],...",
        help="deal the conversations over tenants in these shares (e.g. a:4,b:1), each with its API key and fair-share "
        "weight (default 1) in the API-keys file of the gateways started here (--compare)",
    )
    parser.add_argument(
        "--bands",
        default=None,
        metavar="NAME=PRIORITY:SHARE,...",
        help="deal the requests over priority bands (e.g. interactive=0:0.2,batch=1:0.8); each request carries its "
        "band's `priority` in the body (lower is more urgent)",
    )
    parser.add_argument(
        "--band-slo",
        action="append",
        default=[],
        metavar="BAND:ttft=S[,tpot=S][,e2e=S]",
        help="a band's objectives in seconds (repeat per band); what a band does not set is --slo-*'s",
    )
    parser.add_argument(
        "--api",
        choices=APIS,
        default="chat",
        help="chat (default): messages to /v1/chat/completions, prompts to /v1/completions; responses: both to "
        "/v1/responses, a conversation's later turns as previous_response_id and the new input only (--url runs; "
        "in --compare an entry's +responses)",
    )
    parser.add_argument("--served-model-name", default=None, help="the request's `model` (default: GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token (default: none)")
    parser.add_argument(
        "--history",
        choices=("live", "logged"),
        default="live",
        help="chat turns carry the answers the server streamed (closed-loop sessions, as a chat client; default: "
        "the worker that decoded an answer holds its KV) or resend the logged answers (no worker computed them)",
    )
    parser.add_argument(
        "--think-ms",
        type=float,
        default=CHAT_THINK_MS,
        help=f"chat: mean think time before each turn, exponential and seeded (default {CHAT_THINK_MS:g}; 0: none)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    parser.add_argument(
        "--exact-length",
        action="store_true",
        help="send min_tokens = max_tokens: every answer has the workload's length and, unlike --ignore-eos, no "
        "end-of-turn token inside it, so a closed-loop chat's next turn still hits the answer's cached KV",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request timeout, s")
    parser.add_argument(
        "--tokenizer", default="smollm2", help="model spec whose tokenizer renders the text (default smollm2)"
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help=f"trace:FILE only: tokens per hash id (default {MOONCAKE_BLOCK_TOKENS}; fewer scales the trace down)",
    )
    parser.add_argument("--dump-workload", type=Path, default=None, metavar="JSONL", help="write the rendered requests")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="TTFT / E2E CDFs, per-worker load")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_compare_arguments(parser)


def arrivals_from(args: argparse.Namespace) -> Arrivals:
    try:
        return Arrivals(args.rate, args.concurrency, args.duration, args.time_scale, args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def mix_from(args: argparse.Namespace) -> TrafficMix:
    return TrafficMix(parse_tenants(args.tenants), parse_bands(args.bands))


def objectives_from(args: argparse.Namespace, mix: TrafficMix) -> Objectives:
    try:
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return Objectives(slo, parse_band_slos(args.band_slo, mix.bands, slo), mix.weights)


def workload_from(args: argparse.Namespace, mix: TrafficMix | None = None) -> Workload:
    requests = args.requests
    if requests is None and args.duration is not None and args.rate is not None:
        requests = math.ceil(args.rate * args.duration) + 1  # enough to keep the rate for the whole duration
    try:
        workload = render(
            args.workload,
            requests,
            seed=args.seed,
            model=args.tokenizer,
            block_tokens=args.trace_block_tokens,
            think_ms=args.think_ms,
        )
    except RenderError as exc:
        raise UserError(str(exc)) from None
    if mix is not None:
        workload = mix.apply(workload, args.seed)
    if args.dump_workload is not None:
        dump_jsonl(workload, args.dump_workload)
    return workload


def run(args: argparse.Namespace) -> int:
    if args.compare and args.faults:
        raise UserError("give --compare or --faults, not both")
    mix = mix_from(args)
    objectives = objectives_from(args, mix)
    if args.compare:
        return run_compare(args, workload_from(args, mix), arrivals_from(args), objectives, mix)
    if args.faults:
        if mix.tenants or mix.bands:
            raise UserError("--tenants and --bands are for --url and --compare runs, not --faults")
        if args.api != "chat":
            raise UserError("--api is for --url and --compare runs, not --faults")
        return run_soak(args, workload_from(args), arrivals_from(args))
    if not args.url:
        raise UserError("give --url URL (a running server), --compare LIST or --faults (fleets started here)")
    if mix.tenants:
        raise UserError("--tenants needs fleets the bench starts (--compare), whose gateways get one key per tenant")
    arrivals = arrivals_from(args)
    make_sender: Callable[[], Sender]
    if args.grpc:
        if args.api != "chat":
            raise UserError("--api responses sends over HTTP; drop --grpc")
        model = args.served_model_name or "the served model"
        make_sender = partial(GrpcSender, args.url, args.api_key, args.ignore_eos, args.timeout, args.exact_length)
    else:
        model = args.served_model_name or asyncio.run(served_model(args.url, args.api_key))
        target = Target(args.url, model, args.api_key, args.ignore_eos, args.timeout, args.exact_length, api=args.api)
        make_sender = partial(HttpSender, target)
    workload = workload_from(args, mix)
    print(
        f"kvroute bench: {len(workload.requests):,} requests of {workload.name} to {args.url} ({model}), "
        f"{arrivals.describe()}",
        file=sys.stderr,
    )
    records, duration = asyncio.run(
        run_requests(
            workload, make_sender, arrivals, progress=not args.no_progress, live_history=args.history == "live"
        )
    )
    summary = summarize(records, duration, objectives)
    print(format_summary(summary, f"{workload.name} @ {args.url}"))
    if args.json is not None:
        report = {
            "workload": workload.name,
            "url": args.url,
            "arrivals": arrivals.describe(),
            **bench_json(summary, records),
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        from loadtest.plot import plot_runs

        plot_runs({workload.name: (records, summary.per_worker_requests)}, args.plot, f"{workload.name} @ {args.url}")
    return 0 if summary.completed == summary.requests else 1
