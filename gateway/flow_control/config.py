"""Flow control's settings: the routing config's `flow_control` object (docs/flow_control.md).

    "flow_control": {
      "max_queued": 4096, "max_queued_bytes": 536870912,            this gateway's whole queue
      "tenant_max_queued": 256, "tenant_max_queued_bytes": 67108864, one tenant's requests, every band together
      "max_worker_waiting": 2, "max_worker_staged": 1, "decode_reserve_tokens": 256, "max_kv_usage": 0.95,
      "cache_lookahead": 16, "deadline_share": 0.5,                  cache-aware dispatch
      "defaults": {"max_wait_s": 30, "max_queued": null, "max_queued_bytes": null, "slo": {}},
      "bands": {"0": {"max_wait_s": 1, "slo": {"ttft_s": 1}}, "10": {"max_wait_s": 120}}
    }

Every key is optional. A band is a priority value (lower is more urgent); a band not under `bands` takes
`defaults`, and a band's own keys are laid over them. A band's `max_queued` / `max_queued_bytes` of null
bound it only by the whole queue's. Parsing raises ValueError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.request import PRIORITY_RANGE

CONFIG_KEY = "flow_control"


@dataclass(frozen=True)
class Slo:
    """A band's service-level bounds in seconds (None: not bounded); a request meets them when every one holds."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
        return (
            (self.ttft_s is None or ttft_s <= self.ttft_s)
            and (self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s)
            and (self.e2e_s is None or e2e_s <= self.e2e_s)
        )

    @property
    def bounded(self) -> bool:
        return (self.ttft_s, self.tpot_s, self.e2e_s) != (None, None, None)


@dataclass(frozen=True)
class BandSettings:
    """One band's bounds: how long a request may wait in it, how many requests and bytes it may hold."""

    # A client's own timeout is commonly 60 s; half of it leaves the request time to run once it starts.
    max_wait_s: float = 30.0
    max_queued: int | None = None  # None: bounded by the whole queue only
    max_queued_bytes: int | None = None
    slo: Slo = field(default_factory=Slo)


@dataclass(frozen=True)
class FlowControlConfig:
    """Every setting of the flow-control stage, with the defaults docs/flow_control.md explains."""

    max_queued: int = 4096
    max_queued_bytes: int = 512 * 2**20
    tenant_max_queued: int = 256
    tenant_max_queued_bytes: int = 64 * 2**20
    # A worker is dispatchable while fewer requests than this wait in it (reported, plus those granted to it and
    # not yet sent): a request waiting in a worker holds no blocks, so its prefix can be evicted under it.
    max_worker_waiting: int = 2
    # Requests sent to a worker without room, to wait there for it (reported waiting, plus grants without a first
    # token): the next one starts as room frees, not a load report later; 0: only where a report shows room.
    max_worker_staged: int = 1
    # Blocks kept free for the decode growth of each request sent: min(max_tokens, this) tokens' worth.
    decode_reserve_tokens: int = 256
    # An engine that reports no block count is dispatchable below this KV-cache usage.
    max_kv_usage: float = 0.95
    cache_lookahead: int = 16  # the oldest requests of a band looked at for a prefix a freed worker holds
    # A request that has waited this share of its band's max_wait_s goes before any cache-aware pick.
    deadline_share: float = 0.5
    defaults: BandSettings = field(default_factory=BandSettings)
    bands: dict[int, BandSettings] = field(default_factory=dict)

    def band(self, priority: int) -> BandSettings:
        return self.bands.get(priority, self.defaults)

    @classmethod
    def from_routing_config(cls, options: dict[str, Any]) -> FlowControlConfig:
        """The `flow_control` object of a routing config, taken out of `options` (the rest are the policy's)."""
        raw = options.pop(CONFIG_KEY, {})
        where = f"--routing-config: {CONFIG_KEY}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object")
        raw = dict(raw)
        defaults = _band(raw.pop("defaults", {}), BandSettings(), f"{where}.defaults")
        bands_raw = raw.pop("bands", {})
        if not isinstance(bands_raw, dict):
            raise ValueError(f"{where}.bands must be an object of priority -> band settings")
        bands = {}
        for key, value in bands_raw.items():
            try:
                priority = int(key)
            except ValueError:
                raise ValueError(f"{where}.bands: {key!r} is not an integer priority") from None
            if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
                raise ValueError(f"{where}.bands: priority {priority} is outside {list(PRIORITY_RANGE)}")
            bands[priority] = _band(value, defaults, f"{where}.bands.{key}")
        base = cls()
        values: dict[str, Any] = {}
        for name, kind in _TOP_LEVEL.items():
            if name in raw:
                value = raw.pop(name)
                zero_allowed = name == "max_worker_staged" and value == 0 and not isinstance(value, bool)
                values[name] = 0 if zero_allowed else _number(value, kind, f"{where}.{name}")
        if raw:
            raise ValueError(f"{where} has the unknown key {sorted(raw)[0]!r}")
        config = cls(**{**{n: getattr(base, n) for n in _TOP_LEVEL}, **values}, defaults=defaults, bands=bands)
        if not 0 < config.max_kv_usage <= 1:
            raise ValueError(f"{where}.max_kv_usage must be in (0, 1], got {config.max_kv_usage}")
        if not 0 < config.deadline_share <= 1:
            raise ValueError(f"{where}.deadline_share must be in (0, 1], got {config.deadline_share}")
        return config


_TOP_LEVEL = {
    "max_queued": int, "max_queued_bytes": int, "tenant_max_queued": int, "tenant_max_queued_bytes": int,
    "max_worker_waiting": int, "max_worker_staged": int, "decode_reserve_tokens": int, "max_kv_usage": float,
    "cache_lookahead": int,
    "deadline_share": float,
}  # fmt: skip


def _band(raw: Any, base: BandSettings, where: str) -> BandSettings:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(raw) - {"max_wait_s", "max_queued", "max_queued_bytes", "slo"})
    if unknown:
        raise ValueError(f"{where} has the unknown key {unknown[0]!r}")
    max_wait_s = _number(raw["max_wait_s"], float, f"{where}.max_wait_s") if "max_wait_s" in raw else base.max_wait_s
    bounds = {}
    for name in ("max_queued", "max_queued_bytes"):
        value = raw.get(name, getattr(base, name))
        bounds[name] = None if value is None else int(_number(value, int, f"{where}.{name}"))
    slo = base.slo
    if "slo" in raw:
        if not isinstance(raw["slo"], dict):
            raise ValueError(f"{where}.slo must be an object of ttft_s, tpot_s, e2e_s")
        unknown = sorted(set(raw["slo"]) - {"ttft_s", "tpot_s", "e2e_s"})
        if unknown:
            raise ValueError(f"{where}.slo has the unknown key {unknown[0]!r}")
        slo = Slo(**{k: _number(v, float, f"{where}.slo.{k}") for k, v in raw["slo"].items() if v is not None})
    return BandSettings(max_wait_s, bounds["max_queued"], bounds["max_queued_bytes"], slo)


def _number(value: Any, kind: type, where: str) -> Any:
    """A positive finite number of `kind` (an int is accepted for a float); ValueError naming `where`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)
