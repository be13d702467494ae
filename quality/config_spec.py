"""A side of the comparison as written on the command line: comma-separated `key=value` over EngineConfig's
fields (hyphens or underscores: `kv-cache-dtype=fp8`, `weight-group-size=64`), plus `chat-template=FILE`, a Jinja
template that replaces the model's own. Unknown keys, bad values and unreadable files are UserErrors."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from worker.config import EngineConfig

CHAT_TEMPLATE_KEY = "chat_template"
# Fields a spec may not set: the model is the command's (both sides run one model); the sim fields drive no model.
NOT_IN_SPECS = frozenset({"model", "sim_prefill_us_per_token", "sim_decode_ms_per_step"})
SPEC_KEYS = tuple(f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig) if f.name not in NOT_IN_SPECS) + (
    CHAT_TEMPLATE_KEY.replace("_", "-"),
)
_FIELD_TYPES = typing.get_type_hints(EngineConfig)


@dataclass(frozen=True)
class ConfigSpec:
    """One side: `text` as given, the EngineConfig fields it sets, and its chat template (None: the model's)."""

    text: str
    fields: tuple[tuple[str, Any], ...]  # EngineConfig field -> a value of its type
    chat_template: str | None = None

    def engine_config(self, model: str) -> EngineConfig:
        return EngineConfig(model=model, **dict(self.fields))


def parse_config_spec(text: str, flag: str) -> ConfigSpec:
    """`text` (may be empty: the engine's defaults) as a ConfigSpec; UserError naming `flag`, the key and why."""
    fields: dict[str, Any] = {}
    chat_template = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name = key.strip().replace("-", "_")
        value = value.strip()
        if not sep or not name or not value:
            raise UserError(f"{flag} {text!r}: {item!r} is not key=value")
        if name in fields or (name == CHAT_TEMPLATE_KEY and chat_template is not None):
            raise UserError(f"{flag} {text!r}: {key.strip()} given twice")
        if name == CHAT_TEMPLATE_KEY:
            chat_template = _read_template(value, flag)
        elif name in _FIELD_TYPES and name not in NOT_IN_SPECS:
            fields[name] = _convert(name, value, flag)
        else:
            raise UserError(f"{flag} {text!r}: unknown key {key.strip()!r}; known: {', '.join(SPEC_KEYS)}")
    try:
        EngineConfig(**fields).validate()
    except ValueError as exc:
        raise UserError(f"{flag} {text!r}: {exc}") from exc
    return ConfigSpec(text, tuple(fields.items()), chat_template)


def _convert(name: str, value: str, flag: str) -> object:
    """`value` as field `name`'s type (int, float, bool, str, or one of them or None)."""
    hint = _FIELD_TYPES[name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    if len(kinds) < len(typing.get_args(hint)) and value.lower() == "none":
        return None
    kind = kinds[0]
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise UserError(f"{flag}: {name.replace('_', '-')} must be true or false, got {value!r}")
        return value.lower() == "true"
    if kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            raise UserError(
                f"{flag}: {name.replace('_', '-')} must be a{'n int' if kind is int else ' number'}, got {value!r}"
            ) from None
    return value


def _read_template(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{flag}: chat-template {path!r}: {exc.strerror or exc}") from exc
