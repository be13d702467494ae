"""What `kvroute bench` measures per request, and the summary it prints: the definitions of vLLM's
`benchmark_serving` (vllm/benchmarks/serve.py, backend_request_func.py) and genai-perf, so the figures
compare with theirs.

Per request, times from the moment the request is sent:
  TTFT  the first streamed chunk that carries content (a role-only or empty chunk does not count);
  ITL   the gaps between consecutive content chunks (pooled over all requests for its percentiles);
  E2E   the last byte of the stream (after `[DONE]`);
  TPOT  (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
A request whose answer has no text (the model ended its turn at once: output tokens, no content) completed
and has an E2E but no TTFT, so it is left out of the TTFT percentiles (vLLM counts it a success too).
Output, prompt and cached tokens are the server's `usage` (`prompt_tokens_details.cached_tokens`).

Summary:
  percentiles  `numpy.percentile` (linear interpolation) over the completed requests;
  throughput   completed requests, output tokens and all tokens per second of the run's wall time;
  goodput      the share of all requests sent that completed and met every SLO given (vLLM's
               `request_goodput` is the same count per second, also reported); with bands, each request
               against its band's SLOs (`Objectives`), and the share per band and per tenant too;
  per band     its requests, goodput and TTFT percentiles;
  per tenant   its requests, goodput and served tokens (prompt + output tokens of its completed requests);
  fairness     Jain's index over the tenants' served tokens, each divided by its weight:
               (sum x)^2 / (n * sum x^2), 1 when every tenant got the same tokens per unit of weight, 1/n
               when one got them all; None with fewer than two tenants;
  hits lost in the queue
               of the requests our gateway routed as a prefix `hit` or to a continued response's worker
               (its `x-kvroute-route`: reason=hit or conversation, matched_blocks=M), those whose worker
               found fewer blocks when it admitted them than the pick matched (cached tokens // block size
               < M, M capped at the blocks a prompt may reuse: all but its last token): their blocks were
               evicted while they waited in the worker's queue; None when no response carried a route (a
               peer router);
  continued-turn reuse
               per completed turn that continues a completed turn (`after`: its session's previous one),
               cached tokens / the previous turn's prompt + output tokens less one (the last sampled token
               is never computed), in whole blocks: how much of the conversation so far the turn found
               cached; the median, the minimum and the share at >= REUSE_TARGET, over those turns; None
               without any;
  errors       failed requests by kind (`http_429`, `http_503`, `stream_error`, `timeout`, ...);
  cached share cached prompt tokens / prompt tokens, over the completed requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvroute.hashing import DEFAULT_BLOCK_SIZE

PERCENTILES = (50, 90, 99)
OK = "ok"
REUSE_TARGET = 0.95  # a continued turn that finds this share of its conversation cached (issue 32)


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds; `sent_s` is relative to the run's start."""

    index: int
    sent_s: float
    status: str = OK  # "ok" or an error kind
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None  # x-kvroute-worker of the response
    route: str | None = None  # x-kvroute-route of the response (kvroute's gateway: policy, reason, matched blocks)
    error: str = ""  # the server's message, for a failed request
    session: str | None = None
    tenant: str | None = None  # the request's tenant and band (loadtest.traffic_mix), None outside a mix
    band: str | None = None
    output_text: str = field(default="", repr=False)  # what was streamed (the next chat turn may resend it)
    after: int | None = None  # the index of the request this one continues (its session's previous turn)
    response_id: str | None = None  # the Responses API's id of the answer (the next turn may continue it)
    previous_response_id: str | None = None  # the id this request continued, as sent

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT: the decode time per output token after the first; None for one-token outputs."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means no objective on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"slo {name} must be a positive number, got {value}")

    def to_json(self) -> dict[str, float]:
        """The objectives that are set, e.g. `{"ttft": 500.0}`."""
        figures = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}
        return {k: v for k, v in figures.items() if v is not None}

    def met_by(self, record: RequestRecord) -> bool:
        """True when the request completed and meets every objective (a one-token output has no TPOT
        and so passes the TPOT objective, as in vLLM)."""
        if not record.ok:
            return False
        checks = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, record.tpot_s), (self.e2e_ms, record.e2e_s))
        return all(limit is None or value is None or value * 1e3 <= limit for limit, value in checks)


@dataclass(frozen=True)
class Objectives:
    """What counts as goodput and as a fair share: each band's SLOs (`slo` for a request without a band, or
    in a band not listed) and each tenant's weight (1 for one not listed)."""

    slo: SLO = field(default_factory=SLO)
    band_slos: Mapping[str, SLO] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)

    def slo_of(self, record: RequestRecord) -> SLO:
        return self.band_slos.get(record.band or "", self.slo)

    def met_by(self, record: RequestRecord) -> bool:
        return self.slo_of(record).met_by(record)


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); None for fewer than two values, 1.0 when all are 0."""
    if len(values) < 2:
        return None
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def queue_lost_hits(records: list[RequestRecord], block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, float] | None:
    """`{"hits", "lost", "share"}` over the completed requests our gateway routed as `hit` or `conversation`
    (module docstring); None when no record carries a route."""
    if not any(r.route for r in records):
        return None
    hits = lost = 0
    for record in records:
        route = dict(part.partition("=")[::2] for part in (record.route or "").split("; "))
        if not record.ok or route.get("reason") not in ("hit", "conversation"):
            continue
        matched = min(int(route.get("matched_blocks") or 0), max(record.prompt_tokens - 1, 0) // block_size)
        if matched <= 0:
            continue
        hits += 1
        lost += record.cached_tokens // block_size < matched
    return {"hits": hits, "lost": lost, "share": round(lost / hits, 6) if hits else 0.0}


def continued_reuse(records: list[RequestRecord], block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, float] | None:
    """`{"target", "turns", "median", "min", "share_at_target"}` of the continued turns' reuse (module docstring); None
    when no completed turn continues a completed one."""
    by_index = {r.index: r for r in records}
    ratios = []
    for record in records:
        previous = by_index.get(record.after) if record.after is not None else None
        if not record.ok or previous is None or not previous.ok:
            continue
        reusable = (previous.prompt_tokens + previous.output_tokens - 1) // block_size * block_size
        if reusable > 0:
            ratios.append(record.cached_tokens / reusable)
    if not ratios:
        return None
    return {
        "target": REUSE_TARGET,
        "turns": len(ratios),
        "median": round(float(np.median(ratios)), 6),
        "min": round(min(ratios), 6),
        "share_at_target": round(sum(r >= REUSE_TARGET for r in ratios) / len(ratios), 6),
    }


def percentiles(values_s: list[float], ps: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """`{"mean", "p50", "p90", "p99"}` in milliseconds as numpy computes them; None for no samples."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(v) for p, v in zip(ps, np.percentile(ms, ps), strict=True)}}


@dataclass
class Summary:
    requests: int
    completed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    goodput: float  # share of all requests that completed within every SLO
    goodput_rps: float  # the same requests per second (vLLM's request_goodput)
    slo: SLO
    errors: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cached_token_share: float
    per_worker_requests: dict[str, int]
    # With a traffic mix: {band: {"requests", "completed", "goodput", "ttft_ms": {"p50", "p99"}, "slo_ms"}},
    # {tenant: {"requests", "completed", "goodput", "served_tokens", "weight"}}, Jain's index over the
    # tenants' served tokens per weight; and the hits lost in the workers' queues.
    per_band: dict[str, dict] = field(default_factory=dict)
    per_tenant: dict[str, dict] = field(default_factory=dict)
    fairness: float | None = None
    lost_hits: dict[str, float] | None = None
    reuse: dict[str, float] | None = None  # continued_reuse

    def to_json(self) -> dict:
        def rounded(stats: dict[str, float | None]) -> dict[str, float | None]:
            return {k: None if v is None else round(v, 3) for k, v in stats.items()}

        return {
            "requests": self.requests,
            "completed": self.completed,
            "duration_s": round(self.duration_s, 3),
            "request_throughput": round(self.request_throughput, 4),
            "output_throughput": round(self.output_throughput, 2),
            "total_token_throughput": round(self.total_token_throughput, 2),
            "ttft_ms": rounded(self.ttft_ms),
            "tpot_ms": rounded(self.tpot_ms),
            "itl_ms": rounded(self.itl_ms),
            "e2e_ms": rounded(self.e2e_ms),
            "goodput": round(self.goodput, 6),
            "goodput_rps": round(self.goodput_rps, 4),
            "slo_ms": self.slo.to_json(),
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "cached_token_share": round(self.cached_token_share, 6),
            "per_worker_requests": self.per_worker_requests,
            **({"per_band": self.per_band} if self.per_band else {}),
            **({"per_tenant": self.per_tenant} if self.per_tenant else {}),
            **({"fairness": _rounded(self.fairness)} if self.per_tenant else {}),
            **({"queue_lost_hits": self.lost_hits} if self.lost_hits is not None else {}),
            **({"continued_reuse": self.reuse} if self.reuse is not None else {}),
        }


def _rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def summarize(records: list[RequestRecord], duration_s: float, objectives: Objectives | None = None) -> Summary:
    """The run's summary (see the module docstring). `duration_s` is the wall time from the first request
    sent to the last one finished."""
    objectives = objectives or Objectives()
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    good = sum(objectives.met_by(r) for r in records)
    per_tenant = _per_tenant(records, objectives)
    return Summary(
        requests=len(records),
        completed=len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        ttft_ms=percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=percentiles([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=percentiles([gap for r in done for gap in r.itl_s]),
        e2e_ms=percentiles([r.e2e_s for r in done if r.e2e_s is not None]),
        goodput=good / len(records) if records else 0.0,
        goodput_rps=good / duration,
        slo=objectives.slo,
        errors=dict(sorted(Counter(r.status for r in records if not r.ok).items())),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens,
        cached_token_share=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        per_worker_requests=dict(sorted(Counter(r.worker or "?" for r in done).items())),
        per_band=_per_band(records, objectives),
        per_tenant=per_tenant,
        fairness=jain_index([t["served_tokens"] / t["weight"] for t in per_tenant.values()]),
        lost_hits=queue_lost_hits(records),
        reuse=continued_reuse(records),
    )


def _per_band(records: list[RequestRecord], objectives: Objectives) -> dict[str, dict]:
    out = {}
    for band in sorted({r.band for r in records if r.band is not None}):
        mine = [r for r in records if r.band == band]
        ttft = percentiles([r.ttft_s for r in mine if r.ok and r.ttft_s is not None], (50, 99))
        out[band] = {
            "requests": len(mine),
            "completed": sum(r.ok for r in mine),
            "goodput": round(sum(objectives.met_by(r) for r in mine) / len(mine), 6),
            "ttft_ms": {k: _rounded(ttft[k], 3) for k in ("p50", "p99")},
            "slo_ms": objectives.slo_of(mine[0]).to_json(),
        }
    return out


def _per_tenant(records: list[RequestRecord], objectives: Objectives) -> dict[str, dict]:
    out = {}
    for tenant in sorted({r.tenant for r in records if r.tenant is not None}):
        mine = [r for r in records if r.tenant == tenant]
        out[tenant] = {
            "requests": len(mine),
            "completed": sum(r.ok for r in mine),
            "goodput": round(sum(objectives.met_by(r) for r in mine) / len(mine), 6),
            "served_tokens": sum(r.prompt_tokens + r.output_tokens for r in mine if r.ok),
            "weight": objectives.weights.get(tenant, 1.0),
        }
    return out


def format_reuse(reuse: dict[str, float] | None) -> str:
    """`continued_reuse` in one line: median, minimum, the share at the target and of how many turns."""
    if reuse is None:
        return "-"
    return (
        f"median {reuse['median']:.1%}, min {reuse['min']:.1%}, {reuse['share_at_target']:.0%} of"
        f" {reuse['turns']:.0f} at >= {REUSE_TARGET:.0%}"
    )


def format_summary(summary: Summary, title: str = "") -> str:
    """The printed report: one block of lines, vLLM's layout."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    lines = [f"{'=' * 20} {title or 'kvroute bench'} {'=' * 20}"]
    lines.append(
        f"requests             {summary.completed:,} completed of {summary.requests:,} in {summary.duration_s:.2f} s"
    )
    lines.append(
        f"throughput           {summary.request_throughput:.2f} req/s, {summary.output_throughput:,.1f} output tok/s,"
        f" {summary.total_token_throughput:,.1f} total tok/s"
    )
    lines.append(f"{'latency (ms)':<20} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}")
    for name, stats in (
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
        ("E2E", summary.e2e_ms),
    ):
        lines.append(f"{name:<20} " + " ".join(f"{ms(stats[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in summary.slo.to_json().items())
    lines.append(
        f"goodput              {summary.goodput:.1%} of requests ({summary.goodput_rps:.2f} req/s)"
        + (f" within {slo}" if slo else " (no SLO given: every completed request)")
    )
    lines.append(
        f"cached tokens        {summary.cached_tokens:,} of {summary.prompt_tokens:,} prompt tokens"
        f" ({summary.cached_token_share:.1%})"
    )
    for band, figures in summary.per_band.items():
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in figures["slo_ms"].items()) or "no SLO"
        lines.append(
            f"band {band:<15} {figures['goodput']:.1%} goodput of {figures['requests']:,} ({slo}), TTFT p50"
            f" {ms(figures['ttft_ms']['p50'])} p99 {ms(figures['ttft_ms']['p99'])} ms"
        )
    for tenant, figures in summary.per_tenant.items():
        lines.append(
            f"tenant {tenant:<13} {figures['goodput']:.1%} goodput of {figures['requests']:,},"
            f" {figures['served_tokens']:,} tokens served (weight {figures['weight']:g})"
        )
    if summary.fairness is not None:
        lines.append(f"fairness             {summary.fairness:.3f} (Jain's index, served tokens per weight)")
    if summary.lost_hits is not None:
        lost = summary.lost_hits
        lines.append(f"hits lost in queue   {lost['lost']:,} of {lost['hits']:,} prefix hits ({lost['share']:.1%})")
    if summary.reuse is not None:
        lines.append(f"continued turns      {format_reuse(summary.reuse)} cached of the conversation so far")
    errors = ", ".join(f"{k}: {v}" for k, v in summary.errors.items()) or "none"
    lines.append(f"errors               {errors}")
    workers = ", ".join(f"{k}: {v}" for k, v in summary.per_worker_requests.items()) or "-"
    lines.append(f"per worker           {workers}")
    return "\n".join(lines)
