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
               `request_goodput` is the same count per second, also reported);
  errors       failed requests by kind (`http_429`, `http_503`, `stream_error`, `timeout`, ...);
  cached share cached prompt tokens / prompt tokens, over the completed requests.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
OK = "ok"


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
    output_text: str = field(default="", repr=False)  # what was streamed (the next chat turn may resend it)

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
        }


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    """The run's summary (see the module docstring). `duration_s` is the wall time from the first request
    sent to the last one finished."""
    slo = slo or SLO()
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    good = sum(slo.met_by(r) for r in records)
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
        slo=slo,
        errors=dict(sorted(Counter(r.status for r in records if not r.ok).items())),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens,
        cached_token_share=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        per_worker_requests=dict(sorted(Counter(r.worker or "?" for r in done).items())),
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
    errors = ", ".join(f"{k}: {v}" for k, v in summary.errors.items()) or "none"
    lines.append(f"errors               {errors}")
    workers = ", ".join(f"{k}: {v}" for k, v in summary.per_worker_requests.items()) or "-"
    lines.append(f"per worker           {workers}")
    return "\n".join(lines)
