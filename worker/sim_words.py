"""Words that are one token each: the text `sim` workers answer in and `kvroute bench` renders prompts with.

A word is a lowercase run of 3 to 12 letters with its leading space (`" harbor"`) that the tokenizer encodes
as exactly one token. Text made only of such words re-tokenizes to the same ids, wherever it sits: a
byte-level pre-tokenizer splits at every space, so a word never merges with its neighbour, nor with the
newline or special token of a chat template around it. So a sim worker's streamed answer, sent back as the
next turn's assistant message, is again the very tokens whose KV that worker computed and cached.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from kvroute.tokenizer import Tokenizer

_WORD = re.compile(r"Ġ[a-z]{3,12}")  # byte-level BPE writes the leading space as "Ġ"


class Word(NamedTuple):
    text: str  # with its leading space
    token_id: int


def single_token_words(tokenizer: Tokenizer) -> tuple[Word, ...]:
    """Every such word of `tokenizer`, sorted by text (the same order in every process)."""
    candidates = sorted(w[1:] for w in tokenizer.backend.get_vocab() if _WORD.fullmatch(w))
    encoded = tokenizer.backend.encode_batch([" " + w for w in candidates], add_special_tokens=False)
    return tuple(Word(" " + w, e.ids[0]) for w, e in zip(candidates, encoded, strict=True) if len(e.ids) == 1)
