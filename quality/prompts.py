"""The prompts a comparison runs: `builtin` (quality/builtin_prompts.py) or a JSONL file, one object a line:
`{"messages": [{"role": ..., "content": ...}, ...]}`, rendered through the chat template as the gateway's chat
endpoint renders it, or `{"prompt": "..."}`, plain text as its completions endpoint tokenizes it (no template)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from kvroute.tokenizer import Tokenizer
from quality.builtin_prompts import LONG_FORM, builtin_conversations

BUILTIN = "builtin"


@dataclass(frozen=True)
class Prompt:
    """A chat (`messages`) or a plain-text prompt (`text`): exactly one is set."""

    messages: tuple[dict[str, Any], ...] | None = None
    text: str | None = None

    def render(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids under `tokenizer` and its chat template."""
        if self.messages is not None:
            return tokenizer.encode_chat(list(self.messages))
        assert self.text is not None
        return tokenizer.encode(self.text, add_special_tokens=True)


@dataclass(frozen=True)
class PromptSet:
    """The prompts, and those whose long answers the drift measure follows (`long_form`)."""

    prompts: list[Prompt]
    long_form: list[Prompt]

    def first(self, n: int) -> PromptSet:
        """The first `n` prompts; the long-form ones as they were."""
        return PromptSet(self.prompts[:n], self.long_form)


def load_prompts(source: str, num_long_form: int) -> PromptSet:
    """`builtin` or a JSONL file. The long-form prompts are the built-in LONG_FORM ones, or a file's first
    `num_long_form` (at most). UserError naming the file and line for bad input."""
    if source == BUILTIN:
        prompts = [Prompt(messages=tuple(messages)) for messages in builtin_conversations()]
        first_long = len(prompts) - len(LONG_FORM)
        return PromptSet(prompts, prompts[first_long : first_long + num_long_form])
    path = Path(source)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"--prompts {source!r}: {exc.strerror or exc} (a JSONL file, or 'builtin')") from exc
    prompts = [_parse_line(line, f"{source}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise UserError(f"--prompts {source!r}: no prompts")
    return PromptSet(prompts, prompts[:num_long_form])


def _parse_line(line: str, where: str) -> Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(item, dict) or len(item.keys() & {"messages", "prompt"}) != 1:
        raise UserError(f'{where}: each line is {{"messages": [...]}} or {{"prompt": "..."}}')
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise UserError(f'{where}: "prompt" must be a non-empty string')
        return Prompt(text=item["prompt"])
    messages = item["messages"]
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}')
    return Prompt(messages=tuple(messages))
