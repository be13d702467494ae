"""API keys -> tenants, and each tenant's cache salt (DESIGN §4, tenancy and security).

Keys come from `--api-keys-file` or the `KVROUTE_API_KEYS` environment variable, both a JSON list:

    [{"tenant": "acme", "key_sha256": "<hex sha256 of the key>", "max_concurrency": 8,
      "priority": 10, "min_priority": 0, "weight": 2.0}, ...]

`priority` is the tenant's requests' default priority (0 when absent; lower is more urgent), `min_priority` the
most urgent one a request may ask for (default: `priority`; a request asking for less is clamped to it), and
`weight` its fair share of a band against other tenants' (> 0, default 1): gateway.flow_control. A tenant's
several keys must agree on each.

Only the keys' SHA-256 digests are ever held. A presented key is hashed and looked up by its digest; the
lookup reveals nothing an attacker can use (finding a key from a digest is a preimage attack), and the final
comparison is `hmac.compare_digest`. Several keys may name one tenant (key rotation): they share its salt.
With no keys configured the gateway is open: every request is the one tenant `default`, with the empty salt.

The cache salt of a tenant is derived on the server from its name and never taken from a client:

    salt(tenant) = hex(HMAC-SHA256(secret, "kvroute-tenant-salt-v1" ‖ 0 ‖ tenant))   with KVROUTE_CACHE_SALT_SECRET
                 = hex(SHA-256("kvroute-tenant-salt-v1" ‖ 0 ‖ tenant))               without

so two tenants never share a block, every gateway of a fleet derives the same salts (they must: the workers
key their caches by it), and with the secret set even a client that reaches a worker directly cannot name
another tenant's salt. A salt the client sends is mixed in under the tenant's (`cache_salt`): the result
always starts with the tenant's salt and a NUL, which no other tenant's salt does.

The secret is read from the file $KVROUTE_CACHE_SALT_SECRET_FILE names (a mounted Secret), or from
$KVROUTE_CACHE_SALT_SECRET itself. Without it a tenant's salt is a hash of its name that anyone can compute,
so API keys without a secret are refused unless the operator allows derived salts (`--allow-derived-salt`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import AuthenticationError
from gateway.request import PRIORITY_RANGE, Tenant
from kvroute.credentials import secret_from_env

API_KEYS_ENV = "KVROUTE_API_KEYS"
SALT_SECRET_ENV = "KVROUTE_CACHE_SALT_SECRET"
SALT_SECRET_FILE_ENV = "KVROUTE_CACHE_SALT_SECRET_FILE"
OPEN_TENANT = Tenant(name="default", cache_salt="")
_SALT_DOMAIN = b"kvroute-tenant-salt-v1\x00"


def tenant_salt(tenant: str, secret: bytes | None = None) -> str:
    """The cache salt of a tenant (see the module docstring)."""
    message = _SALT_DOMAIN + tenant.encode()
    if secret:
        return hmac.new(secret, message, hashlib.sha256).hexdigest()
    return hashlib.sha256(message).hexdigest()


def cache_salt(tenant: Tenant, client_salt: str = "") -> str:
    """The salt a request's blocks are hashed with: the tenant's, with the client's mixed in under it. A
    tenant without a salt (the open tenant of a server without API keys) takes the client's as it is, as vLLM
    does: so a kvroute worker's front door behind a gateway hashes with the salt the gateway sent as
    `cache_salt`, the one its KV events carry and the gateway routes on."""
    if not client_salt or not tenant.cache_salt:
        return client_salt or tenant.cache_salt
    return f"{tenant.cache_salt}\x00{client_salt}"


def key_sha256(api_key: str) -> str:
    """The digest to write in an API keys file for `api_key`."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_priority(value: Any) -> bool:
    return _is_int(value) and PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]


_TENANT_FIELDS = {
    "max_concurrency": lambda v: _is_int(v) and v >= 1,
    "priority": _is_priority,
    "min_priority": _is_priority,
    "weight": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"),
}
_TENANT_FIELD_RULES = {
    "max_concurrency": "an integer >= 1",
    "priority": f"an integer in {list(PRIORITY_RANGE)}",
    "min_priority": f"an integer in {list(PRIORITY_RANGE)}",
    "weight": "a number > 0",
}


def _tenant(name: str, salt: str, given: dict[str, Any]) -> Tenant:
    priority = given.get("priority", 0)
    return Tenant(
        name, salt, given.get("max_concurrency"), priority, given.get("min_priority"), float(given.get("weight", 1))
    )


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: Tenant


class Authenticator:
    """Maps a presented API key to its Tenant; `open` when no key is configured."""

    def __init__(self, entries: list[dict[str, Any]] | None = None, salt_secret: bytes | None = None) -> None:
        """`entries`: the parsed JSON list. Raises ValueError naming the entry and field at fault."""
        parsed: list[tuple[str, bytes]] = []
        settings: dict[str, dict[str, Any]] = {}  # tenant -> its settings given so far (several keys must agree)
        for i, entry in enumerate(entries or []):
            where = f"api keys[{i}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: must be an object with tenant, key_sha256, max_concurrency")
            unknown = sorted(set(entry) - {"tenant", "key_sha256", *_TENANT_FIELDS})
            if unknown:
                raise ValueError(f"{where}: unknown field {unknown[0]!r}")
            name, digest_hex = entry.get("tenant"), entry.get("key_sha256")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.tenant: must be a non-empty string")
            try:
                digest = bytes.fromhex(digest_hex) if isinstance(digest_hex, str) else b""
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ValueError(f"{where}.key_sha256: must be 64 hex digits (sha256 of the key)")
            if any(digest == d for _, d in parsed):
                raise ValueError(f"{where}.key_sha256: the same key is listed twice")
            known = settings.setdefault(name, {})
            for field, check in _TENANT_FIELDS.items():
                value = entry.get(field)
                if value is None:
                    continue
                if not check(value):
                    raise ValueError(f"{where}.{field}: must be {_TENANT_FIELD_RULES[field]}, got {value!r}")
                if known.get(field, value) != value:
                    raise ValueError(f"{where}.{field}: tenant {name!r} is given two different values")
                known[field] = value
            if known.get("min_priority", -math.inf) > known.get("priority", 0):
                raise ValueError(f"{where}.min_priority: is above its priority (the tenant's own default)")
            parsed.append((name, digest))
        tenants = {name: _tenant(name, tenant_salt(name, salt_secret), given) for name, given in settings.items()}
        self._keys = {digest: _Key(digest, tenants[name]) for name, digest in parsed}

    @classmethod
    def from_config(
        cls,
        api_keys_file: str | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        allow_derived_salt: bool = False,
    ) -> Authenticator:
        """Keys from the file if given, else from $KVROUTE_API_KEYS, else none (open). The salt secret is
        the file $KVROUTE_CACHE_SALT_SECRET_FILE names, or $KVROUTE_CACHE_SALT_SECRET. Raises ValueError with
        one line on a missing or malformed source, and for keys without a secret unless `allow_derived_salt`."""
        environ = os.environ if environ is None else environ
        value = secret_from_env(SALT_SECRET_FILE_ENV, SALT_SECRET_ENV, environ)
        secret = value.encode() if value else None
        authenticator = cls._from_keys(api_keys_file, environ, secret)
        if not authenticator.open and secret is None and not allow_derived_salt:
            raise ValueError(
                f"API keys are configured but no cache-salt secret: set ${SALT_SECRET_FILE_ENV} to a file holding "
                f"a random secret (or ${SALT_SECRET_ENV}), the same on every gateway; without one, anyone who "
                "reaches a worker can compute a tenant's salt from its name (--allow-derived-salt accepts that)"
            )
        return authenticator

    @classmethod
    def _from_keys(cls, api_keys_file: str | None, environ: Mapping[str, str], secret: bytes | None) -> Authenticator:
        if api_keys_file:
            path = Path(api_keys_file)
            if not path.is_file():
                raise ValueError(f"--api-keys-file: {api_keys_file!r} does not exist")
            text, source = path.read_text(), f"--api-keys-file {api_keys_file}"
        elif environ.get(API_KEYS_ENV):
            text, source = environ[API_KEYS_ENV], f"${API_KEYS_ENV}"
        else:
            return cls(None, secret)
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from exc
        if not isinstance(entries, list):
            raise ValueError(f"{source}: must be a JSON list of keys")
        try:
            return cls(entries, secret)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc

    @property
    def open(self) -> bool:
        return not self._keys

    @property
    def tenants(self) -> list[Tenant]:
        return sorted({k.tenant for k in self._keys.values()}, key=lambda t: t.name) or [OPEN_TENANT]

    def authenticate(self, api_key: str | None) -> Tenant:
        """The caller's tenant; AuthenticationError (401) for a missing or unknown key when keys exist."""
        if not self._keys:
            return OPEN_TENANT
        if not api_key:
            raise AuthenticationError("missing API key; send it as 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(api_key.encode()).digest()
        found = self._keys.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            raise AuthenticationError("invalid API key")
        return found.tenant
