"""The one tokenizer that gateway, worker and replay share: text <-> token ids, the chat template, and
incremental detokenisation for streaming.

Built on the `tokenizers` library, either from a GGUF file's metadata (byte-level BPE: vocabulary, merges,
token types, pre-tokenizer name) or from an HF directory's `tokenizer.json`. `fingerprint` hashes everything
that decides the ids a prompt gets, so a gateway and a worker can check that they agree before they compare
block hashes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvroute.chat_template import render_chat_template
from kvroute.gguf_file import gguf_field, read_gguf

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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) map to their single ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str:
        return self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` (raises ChatTemplateError, a ValueError, on rejected input)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

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


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    A character that spans several byte-level tokens is held back until its last byte arrives, so no delta
    ever contains a broken UTF-8 sequence. Only a short window of recent tokens is decoded per call.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # tokens before this have been emitted

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text they complete ("" while a character is still incomplete)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back tail at the end of the stream (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


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
