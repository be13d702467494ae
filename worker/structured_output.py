"""Grammar-masked decoding: a request's `SamplingParams.structured` compiled against the model's vocabulary
(xgrammar, the library vLLM and SGLang use), one matcher per sequence, its mask applied to that row's logits.

    StructuredOutput ─► GrammarBackend.compile (off the step loop; cached) ─► CompiledGrammar
    add_request: GrammarBackend.constraint(compiled) ─► Sequence.constraint (a GrammarConstraint)
    each step:   mask_logits(logits, constraints)  ─► sample ─► Sequence.append_token ─► constraint.accept

The contract, in order:
1. `GrammarBackend(tokenizer)` describes the vocabulary once per engine (xgrammar's TokenizerInfo: each token's
   bytes; the tokenizer's special tokens as empty strings, so no grammar ever allows one; its EOS as the stop
   tokens). It is built on first use, so a worker that never sees a constraint never imports xgrammar.
2. `compile(structured)` may be slow for a big schema (measured in docs/structured-output.md): the async engine
   calls it in a thread before the request reaches the step loop. It raises InvalidRequest naming `structured`
   when xgrammar refuses the spec. Compiled grammars are kept by xgrammar's compiler cache, keyed by the spec
   and bounded in bytes (`CACHE_BYTES`, least recently used out first).
3. A sequence's matcher has accepted exactly its output tokens: `Sequence.append_token` advances it, and nothing
   else does. A preempted sequence recomputes its KV but keeps its tokens, so its matcher stays as it is.
4. The grammar ends a sequence: once it is complete (`terminated`, after the EOS it then allows), the sequence
   stops with finish_reason "stop", whatever `ignore_eos` says; min_tokens does not apply (the grammar decides
   where the output may end). max_tokens still cuts it ("length").
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvroute.sampling import InvalidRequest, StructuredOutput
from kvroute.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors start with "[05:32:41] /project/cpp/json_schema_converter.cc:5088: ": not the client's news.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
CACHE_BYTES = 256 * 2**20  # compiled grammars kept (xgrammar's compiler cache, least recently used out first)
COMPILE_THREADS = 2  # xgrammar's threads per compile (building a grammar's token-mask cache)


class GrammarConstraint:
    """One sequence's grammar state: the tokens it accepted so far (its output), what it allows next."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's vocabulary (the tokenizer's); a model may pad beyond it
        self.rejected = False  # a token outside the grammar was appended (never, while masks are applied)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def done(self) -> bool:
        """The grammar is complete (its stop token accepted), or was broken: the sequence ends."""
        return self.rejected or self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """Compiles StructuredOutputs for one vocabulary and makes their matchers (the module's contract)."""

    def __init__(self, tokenizer: Tokenizer, cache_bytes: int = CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.cache_bytes = cache_bytes
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                tokenizer = self.tokenizer
                specials = tokenizer.special_token_ids
                vocab = [b"" if i in specials else tokenizer.token_bytes(i) for i in range(self.vocab_size)]
                info = xgrammar.TokenizerInfo(
                    vocab,
                    xgrammar.VocabType.RAW,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(tokenizer.eos_token_ids),
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=COMPILE_THREADS, cache_enabled=True, cache_limit_bytes=self.cache_bytes
                )
            return self._compiler

    def compile(self, structured: StructuredOutput) -> Any:
        """The compiled grammar (an xgrammar.CompiledGrammar); InvalidRequest naming `structured` when the spec
        does not compile. Thread-safe."""
        compiler = self._grammar_compiler()
        try:
            if structured.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if structured.kind == "json_schema":
                return compiler.compile_json_schema(structured.spec, any_whitespace=False)
            return compiler.compile_structural_tag(structured.spec)
        except (RuntimeError, ValueError) as exc:
            reason = _SOURCE_PREFIX.sub("", str(exc).strip())
            raise InvalidRequest("structured", f"the {structured.kind} does not compile: {reason}") from None

    def constraint(self, compiled: Any) -> GrammarConstraint:
        import xgrammar

        return GrammarConstraint(xgrammar.GrammarMatcher(compiled), self.vocab_size)


def mask_logits(logits: torch.Tensor, constraints: list[GrammarConstraint | None]) -> torch.Tensor:
    """A copy of `logits` where each constrained row's tokens the grammar does not allow next are -inf (columns
    past the grammar's vocabulary too: a model's padded rows); rows without a constraint are unchanged."""
    # logits: float32 [N, V_model]
    import xgrammar

    rows = [i for i, c in enumerate(constraints) if c is not None]
    masked = logits.clone()
    if not rows:
        return masked
    vocab = min(c.vocab_size for c in constraints if c is not None)
    bitmask = xgrammar.allocate_token_bitmask(len(constraints), vocab)
    for row in rows:
        constraints[row].fill_bitmask(bitmask, row)  # type: ignore[union-attr]
    width = min(vocab, masked.shape[-1])
    xgrammar.apply_token_bitmask_inplace(
        masked, bitmask.to(masked.device, non_blocking=True), vocab_size=width, indices=rows
    )
    if masked.shape[-1] > width:
        masked[torch.tensor(rows, device=masked.device), width:] = float("-inf")
    return masked
