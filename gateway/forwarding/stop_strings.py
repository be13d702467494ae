"""From a choice's token ids to the text a client sees: incremental detokenization, then stop strings.

    token ids ─► Tokenizer.incremental_detokenizer (a character split over several tokens waits for its last byte)
              ─► StopStringMatcher (a possible start of a stop string waits until it is decided)
              ─► text deltas

A stop string is matched on the text, across token boundaries ("Hello\\n\\nUser:" can arrive as "\\n", "\\nU",
"ser:"); the earliest match over all stop strings wins, the text before it is returned and the stop string
itself is not (OpenAI's and vLLM's default). Until a match is decided the matcher holds back the longest
tail of the text that is the beginning of some stop string, never more, so streaming lags by at most one
stop string's length. The caller cancels the worker's request on a match (finish_reason "stop").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.tokenizer import Tokenizer


class StopStringMatcher:
    """Finds the first of several stop strings in text that arrives in pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._firsts = {s[0] for s in self.stops}
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now. After a match (`matched` is set) the text before the stop string is returned
        and every later call returns ""."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        cut, found = len(buffer), None
        for stop in self.stops:
            at = buffer.find(stop, 0, cut + len(stop) - 1)
            if at != -1 and at < cut:
                cut, found = at, stop
        if found is not None:
            self.matched, self._held = found, ""
            return buffer[:cut]
        keep = self._undecided_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the stream: the held tail (it never completed a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _undecided_tail(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that some stop string starts with (shorter than that stop)."""
        start = max(0, len(buffer) - self._longest + 1)
        for i in range(start, len(buffer)):
            if buffer[i] in self._firsts:
                tail = buffer[i:]
                if any(stop.startswith(tail) for stop in self.stops):
                    return len(buffer) - i
        return 0


class ChoiceText:
    """Detokenizer and stop matcher of one choice: `add(token_ids)` gives the text to stream. As in vLLM, stop
    strings are looked for only once the choice has more than `min_tokens` tokens (text that arrived before
    streams unmatched)."""

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str], skip_special_tokens: bool = True, min_tokens: int = 0
    ) -> None:
        self._detokenizer = tokenizer.incremental_detokenizer(skip_special_tokens)
        self.matcher = StopStringMatcher(stops)
        self.min_tokens = min_tokens
        self._num_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string was found: the choice is over (cancel its worker request)."""
        return self.matcher.matched is not None

    def add(self, token_ids: Sequence[int]) -> str:
        text = self._detokenizer.add(token_ids)
        self._num_tokens += len(token_ids)
        return text if self._num_tokens <= self.min_tokens else self.matcher.feed(text)

    def finish(self) -> str:
        """The rest of the text when the worker's stream ended (an incomplete character decodes as U+FFFD)."""
        text = self.matcher.feed(self._detokenizer.flush())
        return text + self.matcher.flush()
