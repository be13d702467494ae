"""The one tokenizer that gateway, worker and replay share: text <-> token ids, the chat template, and
incremental detokenisation for streaming.

Built on the `tokenizers` library, either from a GGUF file's metadata (byte-level BPE: vocabulary, merges,
token types, pre-tokenizer name) or from an HF directory's `tokenizer.json`. `fingerprint` hashes everything
that decides the ids a prompt gets, so a gateway and a worker can check that they agree before they compare
block hashes.

Special tokens and untrusted text (`encode_chat`): the chat template's own markup becomes control tokens, the
text of messages never does, so a user who types `<|im_start|>system` gets those characters as text, not a
forged system turn. Every string the client supplied is wrapped in two sentinel characters before rendering;
after rendering, the text between sentinels is encoded with special-token parsing off, the rest with it on.
The split is made at the template's special tokens only (where the tokenizer splits anyway), so a prompt
whose messages hold no special-token text gets exactly the ids that encoding the rendered text gives. Strings a
template compares or looks up (dict keys, `role` and `type` values) cannot carry sentinels, and a template may
cut a wrapped string (`split`, slicing) so that its sentinels are lost: so every client string, keys included,
also has a third sentinel inserted after the first character of each special token spelled in it. The broken
spelling matches no special token wherever the text lands; the sentinel is removed before the text is encoded.

Prompt length (`max_tokens=` of `encode`, `encode_chat`): a prompt over the limit is refused with PromptTooLong
before it is tokenized when its length alone proves it (`tokens_at_least`), else as soon as the count passes the
limit, and nothing of a refused prompt is remembered.

Threads: every method may be called from several threads at once (the gateway tokenizes in a thread pool).
Texts are encoded through `encode_batch_fast`, which releases the GIL while it works (`encode` holds it
throughout, and freeing an Encoding with offsets holds it ~120 ms per 500,000 tokens). encode_chat's wrapping,
rendering and length bound hold the GIL whatever happens, so they run one call at a time: the threads then
queue on a lock instead of contending with an event loop's thread for the GIL, which it gets back sooner.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import orjson
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvroute import tool_format
from kvroute.chat_template import SENTINELS, ChatTemplateError, render_chat_template, template_variables
from kvroute.gguf_file import gguf_field, read_gguf
from kvroute.model_source import ModelSource, smollm2_gguf_path

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are plain added tokens.
_NORMAL = int(gguf.TokenType.NORMAL)
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split that a GGUF's `tokenizer.ggml.pre` names, followed by the byte-level mapping."""
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # Every digit on its own, then GPT-2's split (as in SmolLM2's own tokenizer.json).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre not in splits:
        raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not supported (known: default, smollm, {sorted(splits)})")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class PromptTooLong(ValueError):
    """A prompt has more tokens than the caller's `max_tokens`: `tokens` of them (`exact`), or at least
    `tokens` (counted no further, or bounded from its length without tokenizing)."""

    def __init__(self, tokens: int, limit: int, exact: bool) -> None:
        self.tokens, self.limit, self.exact = tokens, limit, exact
        super().__init__(f"the prompt has {self.count} tokens; at most {limit} are accepted")

    @property
    def count(self) -> str:
        """`1234` or `at least 1234`."""
        return str(self.tokens) if self.exact else f"at least {self.tokens}"


class RunCacheUsage(NamedTuple):
    entries: int
    bytes: int  # the texts and their ids, as the cache holds them
    budget: int  # the most bytes it holds


class Tokenizer:
    """Text <-> ids and the chat template for one model. Build with `from_gguf` or `from_hf_dir`."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: list[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = self._compute_fingerprint()
        # The same tokenizer with special-token parsing off: "<|im_start|>" in its input is plain text.
        self._text_backend = HFTokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        self._token_bytes: dict[int, bytes] = {}
        self._run_cache: OrderedDict[tuple[str, str], array] = OrderedDict()
        self._run_cache_bytes = 0
        self._run_cache_budget = DEFAULT_RUN_CACHE_BYTES
        self._run_cache_lock = threading.Lock()
        self._render_lock = threading.Lock()  # see the module's docstring (Threads)
        self._piece_splits: dict[str, list[tuple[str, int | None]]] = {}
        self._special_around: tuple[list[int], list[int]] | None = None  # add_special_tokens' ids, once known
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._special_starts = _special_starts_pattern([t.content for t in added.values() if t.special])
        self._longest_special = max((len(t.content) for t in added.values() if t.special), default=0)
        # The most bytes, and the most word bytes, one token stands for (None: no sound length bound).
        self.max_token_bytes, self.max_token_word_bytes = _token_byte_bounds(
            backend, {t.content for t in added.values()}
        )
        # Without a normalizer, and with no one-character special token, a text in which `_special_starts` finds
        # nothing holds no special token for the tokenizer either.
        specials = [t.content for t in added.values() if t.special]
        self._specials_by_regex = self.max_token_bytes is not None and all(len(t) > 1 for t in specials)

    @classmethod
    def for_model(cls, source: ModelSource) -> Tokenizer:
        """The tokenizer of a resolved model; `tiny` and `sim` use SmolLM2's (their vocabulary is its)."""
        if source.kind not in ("hf", "gguf"):
            return cls.from_gguf(smollm2_gguf_path())
        if source.path is None:
            raise ValueError(f"a {source.kind} model source without a path: {source}")
        return cls.from_hf_dir(source.path) if source.kind == "hf" else cls.from_gguf(source.path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        reader = read_gguf(path)
        model = gguf_field(reader, "tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') is supported")
        tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens", None)
        token_types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", None) or [_NORMAL] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", None)]
        vocab = {token: i for i, token in enumerate(tokens)}

        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, token_types, strict=True))
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])

        bos_id = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
        eos_id = gguf_field(reader, "tokenizer.ggml.eos_token_id", None)
        if bos_id is not None and gguf_field(reader, "tokenizer.ggml.add_bos_token", False):
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        return cls(
            backend,
            chat_template=gguf_field(reader, "tokenizer.chat_template", None),
            bos_token_id=bos_id,
            eos_token_ids=[eos_id] if eos_id is not None else [],
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        chat_template = _hf_chat_template(directory, config)

        def token_id(entry: Any) -> int | None:
            content = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(content) if content else None

        eos_ids = [i for i in [token_id(config.get("eos_token"))] if i is not None]
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id", [])
        for i in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
            if i not in eos_ids:
                eos_ids.append(i)
        return cls(backend, chat_template, bos_token_id=token_id(config.get("bos_token")), eos_token_ids=eos_ids)

    def save_hf_dir(self, directory: str | Path, model_max_length: int | None = None) -> list[Path]:
        """Write this tokenizer as an HF tokenizer folder: `tokenizer.json` (the backend as it is),
        `tokenizer_config.json` (the chat template, bos / eos, the added tokens, `model_max_length` when
        given) and `special_tokens_map.json`; returns the files written. What transformers'
        `AutoTokenizer.from_pretrained(directory)` (so vLLM's and SGLang's `--tokenizer`, guidellm, aiperf) and
        `from_hf_dir` load back: the same ids, the same chat rendering, the same fingerprint. The class named
        is the generic `PreTrainedTokenizerFast`, which takes `tokenizer.json` verbatim (a model's own class
        may rebuild the pre-tokenizer)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        added = self.backend.get_added_tokens_decoder()

        def token_entry(token: AddedToken) -> dict[str, Any]:
            return {
                "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
            }  # fmt: skip

        named = {"bos_token": self.bos_token or None, "eos_token": self.eos_token or None}
        special_map: dict[str, Any] = {
            key: token_entry(added[token_id]) if (token_id := self.backend.token_to_id(content)) in added else content
            for key, content in named.items()
            if content
        }  # fmt: skip
        others = [t.content for _, t in sorted(added.items()) if t.special and t.content not in named.values()]
        if others:
            special_map["additional_special_tokens"] = others
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {str(i): token_entry(t) for i, t in sorted(added.items())},
            **named,
            "additional_special_tokens": others,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        files = {
            "tokenizer.json": self.backend.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "special_tokens_map.json": json.dumps(special_map, indent=2, ensure_ascii=False),
        }
        for name, text in files.items():
            (directory / name).write_text(text + "\n", encoding="utf-8")
        return [directory / name for name in files]

    def encode(self, text: str, add_special_tokens: bool = False, *, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) map to their single ids.
        For trusted text only (a rendered template, a raw completion prompt the caller wrote in full); text
        from a user inside a conversation goes through `encode_chat` or `encode_text`. With `max_tokens`:
        PromptTooLong past it (see the module's docstring)."""
        if max_tokens is not None and (at_least := self.tokens_at_least(text, past=max_tokens)) > max_tokens:
            raise PromptTooLong(at_least, max_tokens, exact=False)
        encoding = _encode_ids(self.backend, text, add_special_tokens)
        if max_tokens is not None and len(encoding) > max_tokens:
            raise PromptTooLong(len(encoding), max_tokens, exact=True)
        return encoding.ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as text only: a special token's spelling becomes ordinary tokens."""
        return _encode_ids(self._text_backend, text, False).ids

    def tokens_at_least(self, text: str, uncounted: Sequence[str] = (), past: int | None = None) -> int:
        """A lower bound on the tokens of `text` however it is encoded, from its length alone (0 when this
        tokenizer has no sound bound). `uncounted`: characters in `text` that are not part of it (encode_chat's
        sentinels). `past`: once the byte bound alone is above it, that bound is returned (a refusal needs no more).

        Sound for byte-level BPE without a normalizer (every GGUF this loader reads; Llama 3, Qwen2, SmolLM2):
        each token stands for a contiguous run of the text's UTF-8 bytes, so a text of B bytes, W of them word
        bytes (ASCII letters and digits, and every byte of a non-ASCII character), has at least
        max(ceil(B / max_token_bytes), ceil(W / max_token_word_bytes)) tokens, the maxima taken over the whole
        vocabulary, special and added tokens included (SmolLM2: 81 bytes, a run of spaces; 25 word bytes,
        "ManagementPlaneProtection"). A BOS or other added markup only adds tokens. A tokenizer with a
        normalizer (which may shrink the text) or another model gets 0: it is tokenized whole, still counted
        before any ids are kept."""
        if self.max_token_bytes is None or self.max_token_word_bytes is None or not text:
            return 0
        encoded = text.encode("utf-8", "surrogatepass")
        marks = sum(text.count(c) * len(c.encode()) for c in uncounted)  # all non-ASCII: word bytes too
        by_bytes = -(-(len(encoded) - marks) // self.max_token_bytes)
        if past is not None and by_bytes > past:
            return by_bytes
        return max(by_bytes, -(-(_word_bytes(encoded) - marks) // self.max_token_word_bytes))

    def limit_run_cache(self, max_bytes: int) -> None:
        """Bound `encode_chat`'s memory of text runs to `max_bytes` (texts and ids; 0 turns it off)."""
        if max_bytes < 0:
            raise ValueError(f"the tokenizer's run cache budget must be >= 0 bytes, got {max_bytes}")
        with self._run_cache_lock:
            self._run_cache_budget = max_bytes
            self._evict()

    @property
    def run_cache_usage(self) -> RunCacheUsage:
        with self._run_cache_lock:
            return RunCacheUsage(len(self._run_cache), self._run_cache_bytes, self._run_cache_budget)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        cache_scope: str | None = None,
        max_tokens: int | None = None,
        **extra: Any,
    ) -> list[int]:
        """The prompt ids for `messages` through the chat template, with no special token taken from the
        messages' (or `extra`'s, e.g. `tools`) strings, keys included: only the template's own markup becomes
        control tokens. Raises ChatTemplateError (a ValueError) on input the template rejects; with
        `max_tokens`, PromptTooLong past it.

        With `cache_scope` (the gateway passes the tenant's cache salt), the ids of each run of text between two
        of the template's special tokens (a system prompt, tool schemas, each earlier turn, the template's own
        short pieces) are remembered for later prompts of the same scope, within `limit_run_cache`'s budget, least
        recently used out first. The tokenizer splits at special tokens itself (no merge crosses one), so a run's
        ids do not depend on what precedes it: a prompt that starts with runs seen before (the conversation so
        far) tokenizes only its new runs, and gets exactly the ids a whole encode gives. The memory maps text to
        ids only, and only within one scope: no scope can learn from the timing whether another sent a text.
        Only a prompt within `max_tokens` is remembered."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        messages, extra = self._with_tools(messages, extra)
        with self._render_lock:
            marks = _pick_sentinels(messages, extra, self.chat_template)
            wrap = self._wrapper(marks)
            rendered = render_chat_template(
                self.chat_template,
                wrap(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **wrap(extra),
            )
            if max_tokens is not None and (at_least := self.tokens_at_least(rendered, marks, max_tokens)) > max_tokens:
                raise PromptTooLong(at_least, max_tokens, exact=False)
        runs = [(text.replace(marks.inner, ""), special_id) for text, special_id in self._runs(rendered, marks)]
        known = self._recall(cache_scope, runs)
        ids: list[int] = []
        fresh: dict[str, array] = {}  # runs to remember once the prompt is within the limit
        for (text, special_id), run_ids in zip(runs, known, strict=True):
            room = None if max_tokens is None else max_tokens - len(ids) - (special_id is not None)
            if run_ids is None:
                run_ids = fresh.get(text)
            if run_ids is None:
                encoding = _encode_ids(self._text_backend, text, False)
                if room is not None and len(encoding) > room:  # counted without building the list of ids
                    assert max_tokens is not None  # room is counted from it
                    raise PromptTooLong(
                        len(ids) + len(encoding) + (special_id is not None), max_tokens, exact=special_id is None
                    )
                run_ids = encoding.ids
                if cache_scope is not None:
                    fresh[text] = array("I", run_ids)
            elif room is not None and len(run_ids) > room:
                assert max_tokens is not None  # room is counted from it
                raise PromptTooLong(
                    len(ids) + len(run_ids) + (special_id is not None), max_tokens, exact=special_id is None
                )
            ids.extend(run_ids)
            if special_id is not None:
                ids.append(special_id)
        if cache_scope is not None:
            self._remember(cache_scope, fresh)
        return ids

    def _with_tools(
        self, messages: list[dict[str, Any]], extra: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and template variables to render: `tools` (extra's) and the history's tool calls and
        results go to a template that reads `tools` as they are; for one that does not, they are written into
        the messages in kvroute.tool_format's Hermes format (its preamble in the system message)."""
        assert self.chat_template is not None
        tools = extra.get("tools")
        if "tools" in template_variables(self.chat_template) or not tool_format.needs_rewrite(messages, tools):
            return messages, extra
        rest = {k: v for k, v in extra.items() if k != "tools"}
        return tool_format.for_template(messages, tools), rest

    def _wrapper(self, marks: _Sentinels) -> Callable[[Any], Any]:
        """`value` with every client string wrapped in sentinels (dict keys and `role`/`type` values only broken
        at special-token spellings: a template looks them up and compares them)."""

        def broken(text: str) -> str:
            return _break_special_tokens(text, self._special_starts, self._longest_special, marks.inner)

        def wrap(value: Any, key: Any = None) -> Any:
            if isinstance(value, str):
                text = broken(value)
                return text if key in _CONTROL_KEYS else _UserText(text, marks.open, marks.close)
            if isinstance(value, dict):
                return {broken(k) if isinstance(k, str) else k: wrap(v, k) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [wrap(v) for v in value]
            return value

        return wrap

    def _runs(self, rendered: str, marks: _Sentinels) -> Iterator[tuple[str, int | None]]:
        """The rendered prompt as (text run, the template's special token id that ends it, or None for the last
        run): template text and user text between two of the template's special tokens, sentinels kept."""
        text_run: list[str] = []
        for piece, is_user_text in _split_marked(rendered, marks.open, marks.close):
            if is_user_text:
                text_run.append(piece)
                continue
            for text, special_id in self._split_at_special_tokens(piece):
                text_run.append(text)
                if special_id is not None:
                    yield "".join(text_run), special_id
                    text_run.clear()
        yield "".join(text_run), None

    def _split_at_special_tokens(self, piece: str) -> list[tuple[str, int | None]]:
        """A piece of template markup as (text, special token id or None) pairs, where the tokenizer itself
        finds special tokens. Remembered: a template renders the same few pieces for every prompt."""
        split = self._piece_splits.get(piece)
        if (
            split is None
            and self._specials_by_regex
            and not (self._special_starts and self._special_starts.search(piece))
        ):
            split = [(piece, None)]  # e.g. client text a template cut out of its sentinels: not tokenized twice
        if split is None:
            encoding = _encode(self.backend, piece, False)
            split, start = [], 0
            for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
                if token_id in self.special_token_ids:
                    split.append((piece[start:begin], token_id))
                    start = end
            split.append((piece[start:], None))
            if len(piece) <= _PIECE_CACHE_MAX_CHARS:
                if len(self._piece_splits) >= _PIECE_CACHE_ENTRIES:
                    self._piece_splits.clear()
                self._piece_splits[piece] = split
        return split

    def _recall(self, scope: str | None, runs: list[tuple[str, int | None]]) -> list[Sequence[int] | None]:
        """Each run's ids from `scope`'s memory, None where it holds none (an empty run's are empty)."""
        if scope is None or not self._run_cache_budget:
            return [None if text else () for text, _ in runs]
        found: list[Sequence[int] | None] = []
        with self._run_cache_lock:
            cache = self._run_cache
            for text, _ in runs:
                if not text:
                    found.append(())
                    continue
                key = (scope, text)
                run_ids = cache.get(key)
                if run_ids is not None:
                    cache.move_to_end(key)
                found.append(run_ids)
        return found

    def _remember(self, scope: str, fresh: dict[str, array]) -> None:
        if not fresh or not self._run_cache_budget:
            return
        with self._run_cache_lock:
            cache = self._run_cache
            for text, run_ids in fresh.items():
                key = (scope, text)
                if key in cache:  # another thread encoded it meanwhile
                    continue
                cache[key] = run_ids
                self._run_cache_bytes += _entry_bytes(key, run_ids)
            self._evict()

    def _evict(self) -> None:
        """Least recently used out until the cache is within its entries and bytes (the lock held)."""
        cache = self._run_cache
        while cache and (len(cache) > _RUN_CACHE_ENTRIES or self._run_cache_bytes > self._run_cache_budget):
            key, run_ids = cache.popitem(last=False)
            self._run_cache_bytes -= _entry_bytes(key, run_ids)

    def add_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """`ids` between the special tokens that `encode(text, add_special_tokens=True)` puts around a text
        (a BOS for models that want one, nothing for most chat models): what vLLM's /tokenize gives for a
        chat with `add_special_tokens: true`."""
        if self._special_around is None:
            plain = self.backend.encode("a", add_special_tokens=False).ids
            full = self.backend.encode("a", add_special_tokens=True).ids
            start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
            self._special_around = (full[:start], full[start + len(plain) :])
        before, after = self._special_around
        return [*before, *ids, *after]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _DECODE_HOLDING_GIL:  # `decode` holds the GIL throughout; `decode_batch` releases it
            return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        found = self._token_bytes.get(token_id)
        if found is None:
            piece = self.backend.id_to_token(token_id) or ""
            if token_id in self.special_token_ids or not all(c in _BYTE_OF_CHAR for c in piece):
                found = self.decode([token_id], skip_special_tokens=False).encode()
            else:
                found = bytes(_BYTE_OF_CHAR[c] for c in piece)
            self._token_bytes[token_id] = found
        return found

    @property
    def bos_token(self) -> str:
        return (self.backend.id_to_token(self.bos_token_id) or "") if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.backend.id_to_token(self.eos_token_ids[0]) or "") if self.eos_token_ids else ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` (raises ChatTemplateError, a ValueError, on rejected input)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        messages, extra = self._with_tools(messages, extra)
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> StreamDetokenizer | ByteLevelDetokenizer:
        """A stream's detokenizer: table lookups where the decoder is plain byte-level (`ByteLevelDetokenizer`),
        else the library's `DecodeStream` (`StreamDetokenizer`); the two give the same deltas."""
        tables = self._byte_level_tables
        if tables is None:
            return StreamDetokenizer(self, skip_special_tokens)
        return ByteLevelDetokenizer(tables[skip_special_tokens])

    @functools.cached_property
    def _byte_level_tables(self) -> tuple[list[bytes], list[bytes]] | None:
        """ByteLevelDetokenizer's tables, indexed by skip_special_tokens (the second shares the first's bytes),
        built on the first stream; None where the decoder is not plain byte-level, or where the library decodes
        an added token otherwise than its spelling says (a `tokenizers` that writes added tokens out as they
        are: `DecodeStream` is exact whatever the library does)."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        spelled = _bytes_of_ids(self.backend)
        for token_id in self.backend.get_added_tokens_decoder():
            if spelled[token_id].decode("utf-8", "replace") != self.decode([token_id], skip_special_tokens=False):
                return None
        return spelled, [b"" if i in self.special_token_ids else b for i, b in enumerate(spelled)]

    def _compute_fingerprint(self) -> str:
        state = json.loads(self.backend.to_str())
        identity = {
            "model": state["model"],
            "normalizer": state.get("normalizer"),
            "pre_tokenizer": state.get("pre_tokenizer"),
            "added_tokens": [(t["id"], t["content"], t["special"]) for t in state.get("added_tokens", [])],
            "chat_template": self.chat_template,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": self.eos_token_ids,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class StreamDetokenizer:
    """Turns a stream of token ids into text deltas, for any decoder: the library's `DecodeStream`, which holds a
    character that spans several tokens back until its last byte arrives (no delta ever holds a broken UTF-8
    sequence), plus the `flush` it lacks.

    `DecodeStream` decodes the tokens it last gave out (the context) with those it holds since; it does not expose
    them, so the two id lists are kept here too, for `flush` to decode the held tail in that context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._skip_special = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []
        self._held: list[int] = []

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text they complete ("" while a character is still incomplete)."""
        if not token_ids:
            return ""
        ids = list(token_ids)
        self._held += ids
        text = self._stream.step(self._backend, ids)
        if text is None:
            return ""
        self._context, self._held = self._held, []
        return text

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an incomplete character decodes as U+FFFD)."""
        if not self._held:
            return ""
        decode, skip = self._backend.decode, self._skip_special
        text = decode(self._context + self._held, skip_special_tokens=skip)[
            len(decode(self._context, skip_special_tokens=skip)) :
        ]
        self._context, self._held = [], []
        self._stream = decoders.DecodeStream(skip_special_tokens=skip)
        return text


class ByteLevelDetokenizer:
    """StreamDetokenizer's deltas, for a tokenizer whose decoder is plain byte-level, by table lookups (`DecodeStream`
    costs 1.4x these at 1 token per message, 5x at 20: docs/gateway.md, "Detokenizing a stream").

    The library's byte-level `decode` maps each token to fixed bytes (its spelling in the byte-level alphabet, or
    its UTF-8 where it is spelled outside it, added tokens alike; nothing for a special token it skips), joins
    them and decodes the whole as UTF-8 with U+FFFD for each invalid part. So a stream is its tokens' bytes fed to
    an incremental UTF-8 decoder (`errors="replace"`), and a delta is held back while the decoder holds an
    incomplete character or the text not yet given out ends in U+FFFD, as `DecodeStream` holds it.
    `tests/test_detokenizer.py` holds the two to the same deltas. Token ids are the wire's (non-negative); an id
    the tokenizer does not know stands for nothing, as in the library's `decode`.
    """

    def __init__(self, bytes_of_ids: list[bytes]) -> None:
        self._bytes_of_ids = bytes_of_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # decoded, not yet given out

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text they complete ("" while a character is still incomplete)."""
        table = self._bytes_of_ids
        try:
            data = b"".join([table[i] for i in token_ids])
        except IndexError:
            data = b"".join([table[i] for i in token_ids if i < len(table)])
        text = self._pending + self._utf8.decode(data)
        if not text or text[-1] == "\ufffd" or self._utf8.getstate()[0]:
            self._pending = text
            return ""
        self._pending = ""
        return text

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an incomplete character decodes as U+FFFD)."""
        text = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        self._utf8.reset()
        return text


def _bytes_of_ids(backend: HFTokenizer) -> list[bytes]:
    """Each token id's bytes in the byte-level decoder's output, special tokens written out (b"" for an id in
    no vocabulary)."""
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        table[token_id] = _spelled_bytes(token, added=False)
    return table


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a token's spelling."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
_LATIN1_OF_CHAR = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}  # str.translate to the bytes, as latin-1
_OUTSIDE_ALPHABET = re.compile(f"[^{re.escape(''.join(_BYTE_OF_CHAR))}]")
# encode_chat's memory of text runs: a 4,096-token run costs ~6 ms to tokenize here, a short one ~5 µs (the
# library call), a lookup ~0.3 µs. Its budget is in bytes held: each run's text, its ids at 4 bytes each, and
# the entry's own key and links (_ENTRY_BYTES).
_RUN_CACHE_ENTRIES = 65536
_ENTRY_BYTES = 100
DEFAULT_RUN_CACHE_BYTES = 64 * 2**20
# _break_special_tokens scans a long string in pieces of this many characters: each regex call holds the GIL.
_SCAN_CHARS = 65536
_PIECE_CACHE_ENTRIES = 4096
_PIECE_CACHE_MAX_CHARS = 1024
# Past this many ids, `decode` goes through `decode_batch`, which lets other threads run while it works (the gateway
# decodes a long /detokenize in its prompt pool); shorter ones take the cheaper call.
_DECODE_HOLDING_GIL = 1024
# Keys whose values a chat template compares or dispatches on: their values get no wrapping sentinels (a
# template that tests `message['role'] == 'user'` must still see "user"), only broken special-token spellings.
_CONTROL_KEYS = frozenset({"role", "type"})


class _Sentinels(NamedTuple):
    open: str  # before a client's string
    close: str  # after it
    inner: str  # after the first character of a special token spelled in a client's string


class _UserText(str):
    """A client's string wrapped in sentinels. `strip` and friends (Jinja's `trim`) act on the text inside, so
    a template that trims content renders the same text as it does unwrapped."""

    inner: str
    marks: tuple[str, str]

    def __new__(cls, inner: str, open_mark: str, close_mark: str) -> _UserText:
        self = super().__new__(cls, f"{open_mark}{inner}{close_mark}")
        self.inner, self.marks = inner, (open_mark, close_mark)
        return self

    def strip(self, chars: str | None = None) -> _UserText:
        return _UserText(self.inner.strip(chars), *self.marks)

    def lstrip(self, chars: str | None = None) -> _UserText:
        return _UserText(self.inner.lstrip(chars), *self.marks)

    def rstrip(self, chars: str | None = None) -> _UserText:
        return _UserText(self.inner.rstrip(chars), *self.marks)


def _all_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _all_strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _all_strings(item)


def _pick_sentinels(messages: Any, extra: Any, template: str) -> _Sentinels:
    """Three sentinel characters that appear in none of the request's strings nor in the template: the first
    three of SENTINELS that do not."""
    try:  # orjson escapes none of SENTINELS (JSON escapes only controls below U+0020, quotes and backslashes)
        seen = orjson.dumps([messages, extra]).decode()
    except TypeError:  # a non-string key, a lone surrogate, a value orjson does not serialise
        seen = "".join(_all_strings([messages, extra]))
    free = list(itertools.islice((c for c in _free_of(template) if c not in seen), 3))  # each test scans the text
    if len(free) < 3:
        raise ChatTemplateError("messages: too many C1 controls and Unicode noncharacters (U+FDD0..U+FDEF) in the text")
    return _Sentinels(*free)


@functools.lru_cache(maxsize=16)
def _free_of(template: str) -> str:
    """SENTINELS without the characters `template` uses, in order (a template is scanned once, not per request)."""
    return "".join(c for c in SENTINELS if c not in template)


def _special_starts_pattern(spellings: list[str]) -> re.Pattern[str] | None:
    """A regex matching the first character of every occurrence of a special token's spelling (overlapping
    ones too: it consumes one character), written as a trie so each candidate position costs a few steps.
    One-character special tokens cannot be broken and are left to the wrapping sentinels."""
    tree: dict[str, dict] = {}
    for spelling in spellings:
        if len(spelling) > 1:
            node = tree
            for char in spelling:
                node = node.setdefault(char, {})
            node[""] = {}
    if not tree:
        return None

    def alternatives(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + alternatives(child) for char, child in sorted(node.items()) if char]
        if "" in node:  # a spelling ends here: the longer ones are optional
            return f"(?:{'|'.join(branches)})?" if branches else ""
        return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"

    return re.compile(
        "|".join(f"{re.escape(first)}(?={alternatives(rest)})" for first, rest in sorted(tree.items())), re.S
    )


def _break_special_tokens(text: str, starts: re.Pattern[str] | None, longest: int, mark: str) -> str:
    """`text` with `mark` after the first character of every special token spelled in it."""
    if starts is None or len(text) < 2 or (len(text) <= _SCAN_CHARS and starts.search(text) is None):
        return text
    cuts = []
    for begin in range(0, len(text), _SCAN_CHARS):
        end = begin + _SCAN_CHARS
        for match in starts.finditer(text, begin, end + longest):  # a spelling that starts here ends in view
            if match.start() >= end:
                break
            cuts.append(match.end())
    if not cuts:
        return text
    return mark.join(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True))


def _encode(backend: HFTokenizer, text: str, add_special_tokens: bool) -> Any:
    """`backend.encode(text)` through `encode_batch`, which releases the GIL while it works (same ids)."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def _encode_ids(backend: HFTokenizer, text: str, add_special_tokens: bool) -> Any:
    """`_encode` without the offsets: the same ids, and freeing its result does not hold the GIL for long
    (a 500,000-token Encoding with offsets takes ~120 ms to free, this one ~2 ms)."""
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]


# What tokens_at_least does not count as word bytes: ASCII other than letters and digits.
_NON_WORD_BYTES = bytes(b for b in range(128) if not chr(b).isalnum())


def _word_bytes(data: bytes) -> int:
    return len(data.translate(None, _NON_WORD_BYTES))


def _token_byte_bounds(backend: HFTokenizer, added: set[str]) -> tuple[int | None, int | None]:
    """The most UTF-8 bytes, and word bytes, of text one token stands for, where that bounds the tokens of a
    text (byte-level BPE, no normalizer: see Tokenizer.tokens_at_least); None elsewhere."""
    state = json.loads(backend.to_str())
    pre = state.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = (state.get("decoder") or {}).get("type") == "ByteLevel" and any(
        p.get("type") == "ByteLevel" for p in pres
    )
    if state.get("normalizer") is not None or not byte_level or state["model"].get("type") != "BPE":
        return None, None
    spellings = [_spelled_bytes(token, token in added) for token in backend.get_vocab(with_added_tokens=True)]
    return max(map(len, spellings)), max(map(_word_bytes, spellings))


def _spelled_bytes(token: str, added: bool) -> bytes:
    """The bytes a vocabulary entry stands for: spelled in the byte-level alphabet (one character per byte), an
    added token as its text (and so is an entry outside the alphabet: more bytes, a weaker bound, still sound)."""
    if added or _OUTSIDE_ALPHABET.search(token):
        return token.encode()
    return token.translate(_LATIN1_OF_CHAR).encode("latin-1")


def _entry_bytes(key: tuple[str, str], run_ids: array) -> int:
    return sys.getsizeof(key) + sys.getsizeof(key[1]) + sys.getsizeof(run_ids) + _ENTRY_BYTES


def _split_marked(rendered: str, open_mark: str, close_mark: str) -> Iterator[tuple[str, bool]]:
    """(piece, is_user_text) in order, the sentinels removed. A sentinel without its partner (a template that
    sliced a string) is dropped; the text after an unmatched opening mark counts as user text."""
    inside = False
    for i, part in enumerate(re.split(f"([{open_mark}{close_mark}])", rendered)):
        if i % 2 == 0:
            if part:
                yield part, inside
        elif part == open_mark:
            inside = True
        else:
            inside = False


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template
