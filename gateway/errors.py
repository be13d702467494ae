"""Every error the gateway answers with, built in one place: each class knows its HTTP status, its gRPC status
code and OpenAI's error `type` / `code`, so the two front doors can never disagree on what a failure is.

The HTTP body is OpenAI's: {"error": {"message", "type", "param", "code"}}. The gRPC status carries the same
message, which starts with the field at fault ("max_tokens: must be ...") when there is one.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import grpc

QUOTED_CHARS = 40  # the most of a client's value an error message repeats


def quoted(value: Any, limit: int = QUOTED_CHARS) -> str:
    """`repr(value)` cut to `limit` characters (with "..."): how an error message names what a client sent,
    so that an answer never grows with the input."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str | bytes) and len(value) > limit:
        value = value[:limit]  # repr of a huge value is never built whole
        return repr(value)[: limit - 3] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GatewayError(Exception):
    """A request the gateway refuses or could not serve; never a 500 for a client's mistake."""

    http_status: ClassVar[int] = 500
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    error_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.message = str(self)
        self.param = param
        self.code = code or self.default_code
        self.retry_after = retry_after

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def http_headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after)))}


class InvalidRequestError(GatewayError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequestError):
    default_code = "context_length_exceeded"


class AuthenticationError(GatewayError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFound(GatewayError):
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class RequestTimeout(GatewayError):
    """The request's head did not arrive whole within the header timeout (a slow or stalled client)."""

    http_status = 408
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class HeadersTooLarge(GatewayError):
    """The request's head passed the header size or count limit."""

    http_status = 431
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"
    default_code = "request_headers_too_large"


class BodyTooLarge(GatewayError):
    http_status = 413
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimited(GatewayError):
    """Over a tenant's concurrency limit, or every worker's queue is full; carries Retry-After."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class NoWorkerAvailable(GatewayError):
    """No live worker can take the request (an empty fleet, every breaker open, every retry failed)."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"
    default_code = "no_worker_available"


class TooManyConnections(GatewayError):
    """This process holds its connection cap; another replica (or a retry after Retry-After) can serve."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"
    default_code = "too_many_connections"


class UpstreamError(GatewayError):
    """The worker failed the request after it started (it died mid-stream, or its engine faulted)."""

    http_status = 502
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "upstream_error"
    default_code = "worker_failed"
