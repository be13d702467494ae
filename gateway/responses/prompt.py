"""A continued turn's prompt ids: the previous turn's prompt and the model's own output ids, then the rest.

The chat template renders the whole conversation again (each text run's ids come from the tokenizer's run
memory, so this is cheap). That rendering spells every earlier answer by encoding its text again, which may
take other ids than the ones the model sampled (byte-level BPE has several spellings of a text), while the
worker's cache holds the sampled ones, and the previous prompt holds them too (it was built this way). So the
prompt sent is the previous prompt, the previous output's ids, and the rendering's rest: turn N+1's prompt is
turn N's prompt plus its output plus the new input, token for token, and its cached prefix reaches into the
last answer. It is taken only where the rendering agrees with it run by run, so a conversation that changed
(other instructions, a template that rewrites answers) is sent as rendered.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol


class Decodes(Protocol):
    @property
    def special_token_ids(self) -> Collection[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def continued_prompt(
    rendered: list[int], previous_prompt: Sequence[int], previous_output: Sequence[int], tokenizer: Decodes
) -> list[int]:
    """The previous prompt, the previous output's ids, then `rendered` (the whole conversation through the
    template) from the special token that closes the previous answer on. That is `rendered` up to the
    spelling of the text runs, which is checked: between their special tokens the two decode to the same
    texts. Otherwise (other instructions, a template that rewrites an answer, an output with special tokens
    inside) `rendered` is returned as it is."""
    special = tokenizer.special_token_ids
    output = list(previous_output)
    while output and output[-1] in special:  # the end-of-turn token the model stopped on: the template writes it
        output.pop()
    prefix = [*previous_prompt, *output]
    marks = [i for i, token in enumerate(prefix) if token in special]
    closing = [i for i, token in enumerate(rendered) if token in special]
    if not previous_prompt or len(closing) <= len(marks):
        return rendered
    end = closing[len(marks)]  # the special token after the previous answer
    if [prefix[i] for i in marks] != [rendered[i] for i in closing[: len(marks)]]:
        return rendered
    for (a_start, a_end), (b_start, b_end) in zip(_runs(marks, len(prefix)), _runs(closing[: len(marks)], end),
                                                  strict=True):  # fmt: skip
        ours, theirs = prefix[a_start:a_end], rendered[b_start:b_end]
        if ours != theirs and tokenizer.decode(ours) != tokenizer.decode(theirs):  # equal ids need no decoding
            return rendered
    return [*prefix, *rendered[end:]]


def _runs(marks: list[int], end: int) -> list[tuple[int, int]]:
    """The spans between the special tokens at `marks`, the last one ending at `end`."""
    starts = [0, *(i + 1 for i in marks)]
    return list(zip(starts, [*marks, end], strict=True))
