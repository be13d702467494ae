"""Seed Q10, "check the chat template and the scoring script before blaming the weights": both sides must feed
the model the same token ids for every prompt, or their answers differ for a reason that is not the candidate's
numerics. The first prompt whose renderings differ is named with the first differing token and the text there."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.tokenizer import Tokenizer

CONTEXT_TOKENS = 8  # tokens of text shown on either side of the first difference


class TemplateMismatch(Exception):
    """The two sides render a prompt to different token ids; the message says which prompt and where."""


def with_template(tokenizer: Tokenizer, chat_template: str | None) -> Tokenizer:
    """`tokenizer`, or the same vocabulary under another chat template (None: the model's own)."""
    if chat_template is None:
        return tokenizer
    return Tokenizer(tokenizer.backend, chat_template, tokenizer.bos_token_id, tokenizer.eos_token_ids)


def check_same_prompts(reference: Sequence[list[int]], candidate: Sequence[list[int]], tokenizer: Tokenizer) -> None:
    """Raise TemplateMismatch at the first prompt whose ids differ between the two renderings."""
    for index, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        if ref == cand:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        raise TemplateMismatch(
            f"prompt {index} renders differently under the two chat templates (reference {len(ref)} tokens, "
            f"candidate {len(cand)}), first at token {at}:\n"
            f"  reference: {_around(ref, at, tokenizer)}\n"
            f"  candidate: {_around(cand, at, tokenizer)}\n"
            "the comparison would measure the templates, not the configurations: give both sides one template"
        )


def _around(ids: list[int], at: int, tokenizer: Tokenizer) -> str:
    before = tokenizer.decode(ids[max(0, at - CONTEXT_TOKENS) : at], skip_special_tokens=False)
    after = tokenizer.decode(ids[at : at + CONTEXT_TOKENS], skip_special_tokens=False)
    return f"{before!r} >>> {after!r}"
