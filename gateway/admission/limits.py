"""Request limits (DESIGN §4): prompt length, max_tokens, body size, n, stop strings, and per-tenant
concurrency. The front doors enforce `max_body_bytes` before parsing; the request path checks the rest.

Defaults are generous enough for a real model and small enough that one client cannot hold a worker for
minutes or a gateway's memory with one request. Every refusal names the field and the limit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gateway.errors import InvalidRequestError, RateLimited
from gateway.request import GatewayRequest, Tenant

# A client over its concurrency waits for one of its own requests to end; a second is a fair guess.
RETRY_AFTER_SECONDS = 1.0


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 32768
    max_tokens: int = 8192
    max_body_bytes: int = 4 * 2**20
    max_n: int = 8
    max_stop: int = 8
    max_stop_chars: int = 256  # per stop string: each is searched in every chunk of text
    tenant_max_concurrency: int | None = None  # for tenants whose key sets none; None = unbounded

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens", "max_body_bytes", "max_n", "max_stop", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.tenant_max_concurrency is not None and self.tenant_max_concurrency < 1:
            raise ValueError(f"--tenant-max-concurrency must be >= 1, got {self.tenant_max_concurrency}")

    def check_request(self, request: GatewayRequest) -> None:
        """The limits a request can be held to before it is tokenized; InvalidRequestError names the field."""
        if not 1 <= request.n <= self.max_n:
            raise InvalidRequestError(f"must be in [1, {self.max_n}], got {request.n}", param="n")
        if request.params.max_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"must be <= {self.max_tokens} on this gateway, got {request.params.max_tokens}", param="max_tokens"
            )
        if len(request.stop) > self.max_stop:
            raise InvalidRequestError(f"at most {self.max_stop} stop strings, got {len(request.stop)}", param="stop")
        for stop in request.stop:
            if not stop or len(stop) > self.max_stop_chars:
                raise InvalidRequestError(
                    f"each stop string must have 1 to {self.max_stop_chars} characters, got {len(stop)}", param="stop"
                )

    def concurrency_of(self, tenant: Tenant) -> int | None:
        return tenant.max_concurrency if tenant.max_concurrency is not None else self.tenant_max_concurrency


class TenantConcurrency:
    """Requests in flight per tenant; `acquire` refuses one past the tenant's limit with RateLimited (429)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.in_flight: defaultdict[str, int] = defaultdict(int)

    def acquire(self, tenant: Tenant) -> None:
        limit = self.limits.concurrency_of(tenant)
        if limit is not None and self.in_flight[tenant.name] >= limit:
            raise RateLimited(
                f"tenant {tenant.name!r} has {limit} requests in flight, its limit; retry when one ends",
                retry_after=RETRY_AFTER_SECONDS,
            )
        self.in_flight[tenant.name] += 1

    def release(self, tenant: Tenant) -> None:
        left = self.in_flight[tenant.name] - 1
        if left > 0:
            self.in_flight[tenant.name] = left
        else:
            del self.in_flight[tenant.name]
