"""A workload's mix of tenants and priority bands (`kvroute bench --tenants`, `--bands`, `--band-slo`).

Tenants: `--tenants a:4,b:1[:WEIGHT]` deals the workload's conversations (a request without a session is one of
its own) over the tenants in those proportions, so a sends 4 conversations for each of b's; the optional third
field is the tenant's fair-share `weight` in the gateway's API-keys file (default 1: equal weights, whatever
each sends). A fleet the bench starts gets an API-keys file with one drawn key per tenant and a drawn cache-salt
secret (`TenantKeys`), and each request carries its tenant's key.

Bands: `--bands interactive=0:0.2,batch=1:0.8` (NAME=PRIORITY:SHARE) deals the requests themselves over the
bands in those proportions; each request carries its band's `priority` in the body, as vLLM takes it (lower is
more urgent). `--band-slo interactive:ttft=1,tpot=0.05` sets a band's objectives in seconds, as the routing
config's `slo` does; a figure a band does not set is the `--slo-*` one.

Both deals are exact (each label's count is its share of the whole, rounded by largest remainder) and shuffled
with the bench's seed, so every arm of a `--compare` run gets the same requests with the same tenants and bands.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gateway.admission.auth import SALT_SECRET_ENV, SALT_SECRET_FILE_ENV, key_sha256, tenant_salt
from kvroute.errors import UserError
from loadtest.bench_stats import SLO
from loadtest.render import Workload

T = TypeVar("T")
SMG_CLASSES = ("interactive", "default", "bulk")  # smg's `x-smg-priority` classes we deal bands over, most urgent first


@dataclass(frozen=True)
class TenantShare:
    name: str
    share: float  # of the conversations, before normalising
    weight: float = 1.0  # fair share, as the API-keys file's `weight`


@dataclass(frozen=True)
class Band:
    name: str
    priority: int  # the body's `priority`: lower is more urgent
    share: float  # of the requests, before normalising


@dataclass(frozen=True)
class TrafficMix:
    """Who sends each request and how urgent it is; empty tuples leave the workload as it is."""

    tenants: tuple[TenantShare, ...] = ()
    bands: tuple[Band, ...] = ()

    @property
    def weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.tenants}

    def apply(self, workload: Workload, seed: int) -> Workload:
        """The workload with each request's `tenant` (one per conversation) and `band`/`priority` set."""
        if not self.tenants and not self.bands:
            return workload
        requests = workload.requests
        units = list(dict.fromkeys(r.session or f"#{r.index}" for r in requests))
        rng = random.Random(f"traffic-mix:{seed}")
        dealt = _deal([t.name for t in self.tenants], [t.share for t in self.tenants], len(units), rng)
        tenant_of = dict(zip(units, dealt, strict=False))
        bands = _deal(list(self.bands), [b.share for b in self.bands], len(requests), rng)
        mixed = []
        for i, request in enumerate(requests):
            tenant = tenant_of.get(request.session or f"#{request.index}") if self.tenants else None
            band = bands[i] if self.bands else None
            mixed.append(
                dataclasses.replace(
                    request,
                    tenant=tenant,
                    band=None if band is None else band.name,
                    priority=None if band is None else band.priority,
                )
            )
        return dataclasses.replace(workload, requests=tuple(mixed))

    def smg_classes(self) -> dict[str, str]:
        """Each band's smg priority class (`x-smg-priority`): the most urgent band `interactive`, the least
        `bulk`, any between `default` (smg's classes are named, not numbered)."""
        ordered = sorted(self.bands, key=lambda b: b.priority)
        if len(ordered) == 1:
            return {ordered[0].name: "default"}
        return {b.name: SMG_CLASSES[0 if i == 0 else 2 if i == len(ordered) - 1 else 1] for i, b in enumerate(ordered)}


def _deal(labels: Sequence[T], shares: Sequence[float], count: int, rng: random.Random) -> list[T]:
    """`count` labels, each `share / sum(shares)` of them (largest remainder), in a seeded shuffle."""
    if not labels:
        return []
    total = sum(shares)
    exact = [count * s / total for s in shares]
    counts = [math.floor(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: count - sum(counts)]:
        counts[i] += 1
    dealt = [label for label, n in zip(labels, counts, strict=True) for _ in range(n)]
    rng.shuffle(dealt)
    return dealt


def _number(text: str, what: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag}: {what} must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag}: {what} must be > 0, got {text!r}")
    return value


def parse_tenants(text: str | None) -> tuple[TenantShare, ...]:
    """`a:4,b:1` or `a:4:2,b:1:1` (NAME:SHARE[:WEIGHT])."""
    if not text:
        return ()
    tenants = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not fields[0]:
            raise UserError(f"--tenants: {item!r} is not NAME:SHARE[:WEIGHT]")
        share = _number(fields[1], f"{fields[0]}'s share", "--tenants")
        weight = _number(fields[2], f"{fields[0]}'s weight", "--tenants") if len(fields) == 3 else 1.0
        tenants.append(TenantShare(fields[0], share, weight))
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise UserError(f"--tenants: a tenant is listed twice: {text!r}")
    return tuple(tenants)


def parse_bands(text: str | None) -> tuple[Band, ...]:
    """`interactive=0:0.2,batch=1:0.8` (NAME=PRIORITY:SHARE)."""
    if not text:
        return ()
    bands = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, _, rest = item.partition("=")
        priority, _, share = rest.partition(":")
        if not name or not priority or not share:
            raise UserError(f"--bands: {item!r} is not NAME=PRIORITY:SHARE")
        try:
            level = int(priority)
        except ValueError:
            raise UserError(f"--bands: {name}'s priority must be an integer, got {priority!r}") from None
        bands.append(Band(name, level, _number(share, f"{name}'s share", "--bands")))
    names = [b.name for b in bands]
    if len(set(names)) != len(names):
        raise UserError(f"--bands: a band is listed twice: {text!r}")
    return tuple(bands)


def parse_band_slos(items: Sequence[str], bands: Sequence[Band], default: SLO) -> dict[str, SLO]:
    """`--band-slo BAND:ttft=S[,tpot=S][,e2e=S]` (seconds), each over `default`; every band has an entry."""
    slos = {b.name: default for b in bands}
    for item in items:
        name, _, figures = item.partition(":")
        if name not in slos:
            raise UserError(f"--band-slo: unknown band {name!r} in {item!r}; --bands names {', '.join(slos) or 'none'}")
        ms = {}
        for figure in (f.strip() for f in figures.split(",") if f.strip()):
            key, _, value = figure.partition("=")
            if key not in ("ttft", "tpot", "e2e"):
                raise UserError(f"--band-slo: {figure!r} in {item!r}: give ttft=S, tpot=S or e2e=S (seconds)")
            ms[f"{key}_ms"] = _number(value, f"{name}'s {key}", "--band-slo") * 1e3
        if not ms:
            raise UserError(f"--band-slo: {item!r} sets no objective; e.g. {name}:ttft=1")
        slos[name] = dataclasses.replace(slos[name], **ms)
    return slos


@dataclass(frozen=True)
class TenantKeys:
    """One drawn API key per tenant, the API-keys file naming them (with their weights) and a drawn cache-salt
    secret, for the gateways the bench starts."""

    keys: dict[str, str]
    api_keys_file: Path
    secret: str
    secret_file: Path

    @classmethod
    def write(cls, tenants: Sequence[TenantShare], directory: Path) -> TenantKeys:
        """Draw and write them under `directory` (owner-only files). A weight of 1 is left out: the default, and
        what a gateway without weights understands."""
        keys = {t.name: f"kvr-bench-{t.name}-{secrets.token_urlsafe(16)}" for t in tenants}
        entries = [
            {
                "tenant": t.name,
                "key_sha256": key_sha256(keys[t.name]),
                **({"weight": t.weight} if t.weight != 1 else {}),
            }
            for t in tenants
        ]
        secret = secrets.token_hex(32)
        api_keys_file, secret_file = directory / "bench-api-keys.json", directory / "bench-cache-salt-secret"
        for path, text in ((api_keys_file, json.dumps(entries, indent=2)), (secret_file, secret)):
            path.write_text(text)
            path.chmod(0o600)
        return cls(keys, api_keys_file, secret, secret_file)

    def gateway_env(self) -> dict[str, str]:
        """The gateway's environment: this process's, with the salt secret's file (and not its value, which the
        gateway would refuse beside the file)."""
        env = {k: v for k, v in os.environ.items() if k != SALT_SECRET_ENV}
        return {**env, SALT_SECRET_FILE_ENV: str(self.secret_file)}

    def salts(self) -> dict[str, str]:
        """Each tenant's cache salt as the gateway derives it (for the replay's block hashes)."""
        return {name: tenant_salt(name, self.secret.encode()) for name in self.keys}
