"""Sampling parameters and request validation, shared by the gateway (HTTP/gRPC input) and the worker."""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by a smaller one overflows float32
# logits, and its distribution is the argmax's to within rounding anyway.
SAMPLING_EPS = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_STOP_TOKEN_IDS = 128  # each generated token is checked against them


class InvalidRequest(ValueError):
    """A request the server must refuse (gRPC INVALID_ARGUMENT / HTTP 400); `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


StructuredKind = Literal["json_schema", "json_object", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained output must match (the wire's `kvroute.v1.StructuredOutput`): `kind` json_schema with
    the schema's JSON text as `spec`, json_object (spec empty), or structural_tag with xgrammar's structural-tag
    JSON (kvroute.tool_format builds the tool calls' one). Hashable: the worker's compiled-grammar cache keys
    on it."""

    kind: StructuredKind
    spec: str = ""

    def validate(self) -> None:
        """Raise InvalidRequest (field `structured`) unless the kind is known and its spec is a JSON object;
        whether the grammar compiles is the worker's to say."""
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequest("structured", "json_object takes no spec")
            return
        if self.kind not in ("json_schema", "structural_tag"):
            raise InvalidRequest("structured", f"unknown kind {self.kind!r}")
        try:
            parsed = json.loads(self.spec)
        except ValueError as exc:
            raise InvalidRequest("structured", f"{self.kind} is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("structured", f"{self.kind} must be a JSON object")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # stopping tokens (EOS, stop_token_ids) cannot be sampled before this many output tokens
    logprobs: bool = False  # report the logprob of each chosen token
    top_logprobs: int = 0  # with logprobs: also the top_logprobs most likely tokens at each position
    structured: StructuredOutput | None = None  # grammar-masked decoding (worker/structured_output.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                "stop_token_ids", f"has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                "top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs=true")
        if self.structured is not None:
            self.structured.validate()


def validate_prompt(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, max_tokens: int, known_ids: int = 0
) -> None:
    """Raise InvalidRequest unless the prompt is non-empty, in-vocabulary and fits the context window. The first
    `known_ids` ids are known to be in the vocabulary (the caller's word): only the ids after them are scanned."""
    if len(token_ids) == 0:
        raise InvalidRequest("prompt", "is empty; send at least one token")
    if len(token_ids) >= max_model_len:
        raise InvalidRequest("prompt", f"has {len(token_ids)} tokens; the model's context is {max_model_len} tokens")
    unknown = token_ids[known_ids:] if known_ids else token_ids
    bad = _out_of_vocabulary(unknown, vocab_size) if len(unknown) else None
    if bad is not None:
        raise InvalidRequest("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) + max_tokens > max_model_len:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"of {max_model_len} tokens",
        )


def _out_of_vocabulary(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The first id outside [0, vocab_size), or None. A long prompt's ids are checked in C: copied into a uint32
    array (which refuses a negative id, one past 2**32 or a non-integer) and its max taken by numpy, ~5x faster
    than Python's min and max over the list (12% of a replay's time went to them). The scan that names the bad
    id runs only when that check fails."""
    ids = array("I")
    try:
        if isinstance(token_ids, list):
            ids.fromlist(token_ids)
        else:
            ids.extend(token_ids)
    except (TypeError, OverflowError):
        pass
    else:
        if int(np.frombuffer(ids, dtype=ids.typecode).max()) < vocab_size:
            return None
    return next((t for t in token_ids if not 0 <= t < vocab_size), None)
