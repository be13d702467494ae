"""Rendering a model's Jinja chat template the way transformers' `apply_chat_template` does.

The environment matches transformers' (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson`
that does not HTML-escape, `raise_exception`, `strftime_now`, a pass-through `{% generation %}` tag), so the
same template gives the same prompt text here as in the reference tokenizer. One difference: `tojson` with
`ensure_ascii` leaves the SENTINELS unescaped, since kvroute.tokenizer marks client text with them and an escaped
mark would no longer mark it (other text, and any text without those characters, is escaped as json.dumps does).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the messages (e.g. its `raise_exception("...")`), or does not compile."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# Characters kvroute.tokenizer may mark client text with (those a request and the template do not hold): C1
# controls first (they keep an ASCII prompt's strings one byte per character, where the noncharacters would make
# them two), but not U+0085, which str.strip() and splitlines() treat as a line break; then the 32 noncharacters.
SENTINELS = [chr(c) for c in range(0x80, 0xA0) if c != 0x85] + [chr(c) for c in range(0xFDD0, 0xFDF0)]
_ESCAPED_BY_ENSURE_ASCII = re.compile(f"[^\x00-\x7f{''.join(SENTINELS)}]")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    text = json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    if ensure_ascii:  # as json.dumps escapes it (surrogate pairs past the BMP), the sentinels excepted
        text = _ESCAPED_BY_ENSURE_ASCII.sub(lambda m: json.dumps(m.group())[1:-1], text)
    return text


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables `template` reads from its context (`messages`, `tools`, ...)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt text for `messages`; `extra` (e.g. `tools`) is passed to the template as variables."""
    try:
        return compile_chat_template(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from exc
