"""The secrets a fleet's processes share, read where both sides find them: from a file (a mounted Kubernetes
Secret) or, for local use, from an environment variable; never from a command line, where `ps` shows them.

- The worker token: the bearer token gateways present to workers (`authorization: Bearer <token>` in the
  metadata of every `kvroute.v1.Worker` call). `kvroute worker --auth-token-file PATH` and `kvroute gateway
  --worker-token-file PATH`, else $KVROUTE_WORKER_TOKEN_FILE, else $KVROUTE_WORKER_TOKEN (the value itself).
  A worker with a token refuses every call without it (worker.service.TokenAuthInterceptor).
- The Redis password: $KVROUTE_REDIS_PASSWORD_FILE, passed to the client (kvroute.fleet_keys.redis_client)
  beside a URL that carries none.
- The cache-salt secret of the gateway's tenants: $KVROUTE_CACHE_SALT_SECRET_FILE or
  $KVROUTE_CACHE_SALT_SECRET (gateway.admission.auth).

A secret file holds the secret alone; surrounding whitespace (the newline an editor or `echo` adds) is not
part of it. Every reader raises ValueError with one line naming the flag or variable at fault.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

WORKER_TOKEN_FILE_ENV = "KVROUTE_WORKER_TOKEN_FILE"
WORKER_TOKEN_ENV = "KVROUTE_WORKER_TOKEN"
REDIS_PASSWORD_FILE_ENV = "KVROUTE_REDIS_PASSWORD_FILE"
AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
MIN_TOKEN_CHARS = 16  # 16 random characters of token_urlsafe carry 96 bits


def read_secret_file(path: str | os.PathLike[str], source: str) -> str:
    """The secret in the file at `path`, stripped of surrounding whitespace; `source` names where the path
    came from (a flag or variable) in the error. Raises ValueError when it cannot be read or is empty."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{source}: cannot read the secret file {str(path)!r} ({why})") from None
    secret = text.strip()
    if not secret:
        raise ValueError(f"{source}: the secret file {str(path)!r} is empty")
    return secret


def secret_from_env(
    file_env: str, value_env: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """A secret from the file named by $`file_env`, else the value of $`value_env`, else None. Setting both
    is refused: one of them would be silently ignored."""
    environ = os.environ if environ is None else environ
    path, value = environ.get(file_env), environ.get(value_env) if value_env else None
    if path and value:
        raise ValueError(f"${file_env} and ${value_env} are both set; set only one")
    if path:
        return read_secret_file(path, f"${file_env}")
    return value or None


def worker_token(token_file: str | None = None, flag: str = "", environ: Mapping[str, str] | None = None) -> str | None:
    """The worker token: from `token_file` (given with `flag`) if set, else from the environment (see the
    module docstring); None when none is configured. Raises ValueError for an unreadable file or a token
    that is too short or not printable ASCII (gRPC metadata carries nothing else)."""
    token: str | None
    if token_file:
        token, source = read_secret_file(token_file, flag), flag
    else:
        token = secret_from_env(WORKER_TOKEN_FILE_ENV, WORKER_TOKEN_ENV, environ)
        source = f"${WORKER_TOKEN_FILE_ENV} / ${WORKER_TOKEN_ENV}"
    if token is None:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source}: the worker token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; "
            f"generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if not all("!" <= char <= "~" for char in token):
        raise ValueError(f"{source}: the worker token must be printable ASCII without spaces")
    return token


def redis_password(environ: Mapping[str, str] | None = None) -> str | None:
    """The Redis password from $KVROUTE_REDIS_PASSWORD_FILE, or None."""
    return secret_from_env(REDIS_PASSWORD_FILE_ENV, None, environ)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `token` to a worker (empty without one)."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def generate_secret() -> str:
    """A fresh random token or secret (256 bits), for a local fleet that makes its own."""
    return secrets.token_urlsafe(32)
