"""The KV events that vLLM and SGLang publish over ZMQ, decoded and encoded: the wire format both sides of
kvroute share (the gateway's subscriber decodes it, the worker's publisher encodes it; DESIGN §3, §4).

A message on the PUB socket is three frames: `[topic, seq, payload]`. `seq` is an 8-byte big-endian signed
integer that starts at 0 when the engine's publisher starts and grows by one per batch (-1 only ends a replay).
`payload` is msgpack: an `EventBatch`, always positional, `[ts, events]` or `[ts, events, dp_rank]` (vLLM calls
the third field `data_parallel_rank`, SGLang `attn_dp_rank`). Each event comes in one of two shapes, and both
are accepted:

  - a map tagged by `type` (vLLM 0.33, SGLang 0.5.23): `{"type": "BlockStored", "block_hashes": [...], ...}`,
    optional fields left out when unset;
  - a positional array with the tag first (older vLLM and SGLang): `["BlockStored", block_hashes, ...]`, the
    fields in vLLM's order (`BLOCK_STORED_FIELDS`, `BLOCK_REMOVED_FIELDS`), trailing ones optional.

Events: `BlockStored` (a run of full blocks chained onto `parent_block_hash`, None for a sequence's first
block; `token_ids` are the run's tokens, `block_size` per block), `BlockRemoved`, `AllBlocksCleared`. Block
hashes are the engine's own values, ints (vLLM's default, 64 bits; SGLang's may be signed) or bytes (vLLM
with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); routers must not compare them with anyone else's, only use
them to name blocks within one engine's stream.

`extra_keys` (vLLM, one entry per block or None): the untagged keys vLLM mixed into that block's hash, in
order: the LoRA name (when `lora_name` is set), `(mm_identifier, offset)` pairs, the request's `cache_salt`
(first block of a request only), prompt-embedding digests (bytes). SGLang carries the salt as a field,
`cache_salt`, instead. `BlockStored.cache_salt()` and `.foreign_keys(i)` read both.

The replay socket (a ROUTER) takes `[b"", start_seq]` from a DEALER and answers every buffered batch with
seq >= start_seq, as `[b"", topic, seq, payload]` (vLLM 0.33, SGLang) or `[b"", seq, payload]` (older vLLM),
then an end marker whose seq is -1.

Contract: `decode_batch(payload)` returns an `EventBatch` or raises `KVEventDecodeError` (the one error type
for bad input: not msgpack, wrong shapes or types, an unknown tag, over a bound); nothing else escapes it for
any bytes. The same, one event at a time (a subscriber that must not hold its event loop while a large batch
is decoded): `head = open_batch(payload)`, then `decode_event(raw, budget)` for each of `head.events` with one
`BatchBudget` per batch. Every bound is checked before what it bounds is decoded: the batch's bytes, then its
event count (from the array's header), then each event's blocks and tokens, and the batch's running totals
(from the headers of the event's arrays). `encode_batch` writes vLLM 0.33's shape.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

EngineHash = int | bytes
# Bounds on one batch, far above what one engine step publishes (one BlockStored per run of new blocks and
# one BlockRemoved per eviction; SGLang one BlockStored per page), so only a broken or hostile sender hits them.
MAX_BATCH_BYTES = 16 * 1024 * 1024
MAX_EVENTS_PER_BATCH = 100_000
# One BlockStored is one request's new blocks in one engine step: at most a step's token budget, which is the
# context length when chunked prefill is off (128k for most long-context models).
MAX_TOKENS_PER_EVENT = 1 << 17
MAX_BLOCKS_PER_EVENT = 1 << 17  # a block is at least one token (SGLang's pages)
# A batch's whole work, however it is packed: one-byte ids and hashes would let 16 MiB carry 8 M blocks.
MAX_TOKENS_PER_BATCH = 1 << 24
MAX_BLOCKS_PER_BATCH = 1 << 20
END_SEQ = -1

BLOCK_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
    "session_id", "lookahead_token_ids",
)  # fmt: skip
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
GPU_MEDIA = frozenset({None, "GPU"})


class KVEventDecodeError(ValueError):
    """A batch (or a frame around it) that is not the wire format; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    salt: str | None = None  # SGLang's `cache_salt` field

    def cache_salt(self) -> str:
        """The salt the run's first block was hashed under, "" for none: SGLang's field, else the string in
        vLLM's first extra key that is not the LoRA name. Only a run that starts a sequence names one."""
        if self.salt is not None:
            return self.salt
        keys = self.extra_keys[0] if self.extra_keys else None
        if not keys:
            return ""
        strings = [k for k in keys if isinstance(k, str)]
        if self.lora_name is not None and strings and strings[0] == self.lora_name:
            strings = strings[1:]
        return strings[0] if strings else ""

    def foreign_keys(self, i: int) -> tuple[Any, ...]:
        """Block i's extra keys that kvroute's gateway cannot reproduce (multimodal items, prompt embeddings):
        a block hashed with any of them must never match a text prompt's block."""
        keys = self.extra_keys[i] if self.extra_keys and i < len(self.extra_keys) else None
        if not keys:
            return ()
        return tuple(k for k in keys if not isinstance(k, str))


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class BatchHead:
    """A batch whose events are still undecoded: each is decoded with `decode_event`."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class BatchBudget:
    """Blocks and token ids one batch's events have carried so far (for the per-batch bounds)."""

    blocks: int = 0
    tokens: int = 0

    def take(self, blocks: int, tokens: int) -> None:
        """Count one event's blocks and tokens; KVEventDecodeError past a bound, before they are decoded."""
        if blocks > MAX_BLOCKS_PER_EVENT or tokens > MAX_TOKENS_PER_EVENT:
            raise KVEventDecodeError(
                f"an event of {blocks} blocks and {tokens} token ids is over the bound of {MAX_BLOCKS_PER_EVENT} "
                f"blocks and {MAX_TOKENS_PER_EVENT} token ids"
            )
        self.blocks += blocks
        self.tokens += tokens
        if self.blocks > MAX_BLOCKS_PER_BATCH or self.tokens > MAX_TOKENS_PER_BATCH:
            raise KVEventDecodeError(
                f"the batch's events carry over the bound of {MAX_BLOCKS_PER_BATCH} blocks or "
                f"{MAX_TOKENS_PER_BATCH} token ids"
            )


class _Head(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: int | None = None


_UINT32 = "I" if array("I").itemsize == 4 else "L"
_decoder = msgspec.msgpack.Decoder()
_head_decoder = msgspec.msgpack.Decoder(_Head)
# An event this small cannot carry more than the per-event bounds (an id or a hash is at least a byte), so it is
# decoded whole; a larger one field by field, its arrays' lengths read from their headers first.
_WHOLE_EVENT_BYTES = 64 * 1024
_event_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw] | list[msgspec.Raw])
_encoder = msgspec.msgpack.Encoder()
_SEQ_BYTES = 8


def decode_seq(frame: bytes) -> int:
    """The sequence number of a message (8 bytes, big-endian, signed)."""
    if len(frame) != _SEQ_BYTES:
        raise KVEventDecodeError(f"a sequence frame is {_SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(_SEQ_BYTES, "big", signed=True)


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """One EventBatch from its msgpack bytes; KVEventDecodeError for anything else (see the module contract)."""
    head = open_batch(payload)
    budget = BatchBudget()
    return EventBatch(head.ts, tuple(decode_event(e, budget) for e in head.events), head.data_parallel_rank)


def open_batch(payload: bytes | memoryview) -> BatchHead:
    """A batch's timestamp, rank and undecoded events; KVEventDecodeError past `MAX_BATCH_BYTES` (before it is
    read) or `MAX_EVENTS_PER_BATCH` (from the events array's header), or for any other shape."""
    if len(payload) > MAX_BATCH_BYTES:
        raise KVEventDecodeError(f"batch of {len(payload)} bytes is over the {MAX_BATCH_BYTES}-byte bound")
    try:
        head = _head_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise KVEventDecodeError(
            f"an EventBatch is an array [ts, events, dp_rank?] of at most {MAX_EVENTS_PER_BATCH} events: {exc}"
        ) from None
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    return BatchHead(head.ts, head.events, head.data_parallel_rank)


def decode_event(raw: msgspec.Raw, budget: BatchBudget) -> KVCacheEvent:
    """One event of an `open_batch` head; its blocks and tokens counted in `budget` (one per batch) before
    they are decoded. KVEventDecodeError for bad input or past a bound."""
    try:
        event = _decoder.decode(raw) if len(raw) <= _WHOLE_EVENT_BYTES else _event_decoder.decode(raw)
        return _decode_event(event, budget)
    except KVEventDecodeError:
        raise
    except (msgspec.DecodeError, TypeError, ValueError, KeyError, IndexError, RecursionError) as exc:
        raise KVEventDecodeError(f"malformed event: {exc!r}"[:200]) from None


def encode_batch(batch: EventBatch) -> bytes:
    """vLLM 0.33's shape: the batch positional, each event a map tagged by `type`, unset optionals left out."""
    events = [_encode_event(e) for e in batch.events]
    raw: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        raw.append(batch.data_parallel_rank)
    return _encoder.encode(raw)


# -- events ---------------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(event: dict[str, Any] | list[Any], names: Sequence[str], tag: str) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    if len(event) - 1 > len(names):
        raise KVEventDecodeError(f"{tag} has {len(event) - 1} fields, at most {len(names)} are known")
    return dict(zip(names, event[1:], strict=False))


def _array_length(value: Any) -> int:
    """An array's length: a decoded one's, or the count in an undecoded one's header, read without decoding it
    (0 for anything else: its decoding then fails on its type)."""
    if isinstance(value, list):
        return len(value)
    if not isinstance(value, msgspec.Raw):
        return 0
    view = memoryview(value)
    first = view[0] if len(view) else 0
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first in (0xDC, 0xDD):
        return int.from_bytes(view[1 : 3 if first == 0xDC else 5], "big")
    return 0


def _value(value: Any) -> Any:
    """A field's value, decoded where it is still msgpack."""
    return _decoder.decode(value) if isinstance(value, msgspec.Raw) else value


def _decoded(f: dict[str, Any], name: str) -> Any:
    return _value(f.get(name))


def _decode_event(event: Any, budget: BatchBudget) -> KVCacheEvent:
    """`event`: a map or array whose values are decoded, or still msgpack (`msgspec.Raw`)."""
    if isinstance(event, dict):
        tag = _decoded(event, "type")
    elif isinstance(event, list) and event:
        tag = _value(event[0])
    else:
        raise KVEventDecodeError("an event is a map tagged by 'type' or an array with its tag first")
    if tag == "BlockStored":
        f = _fields(event, BLOCK_STORED_FIELDS, tag)
        budget.take(_array_length(f.get("block_hashes")), _array_length(f.get("token_ids")))
        return _block_stored(f)
    if tag == "BlockRemoved":
        f = _fields(event, BLOCK_REMOVED_FIELDS, tag)
        budget.take(_array_length(f.get("block_hashes")), 0)
        return BlockRemoved(
            _hashes(_value(f["block_hashes"])), _opt_str(_decoded(f, "medium"), "medium"),
            _opt_int(_decoded(f, "group_idx"), "group_idx"),
        )  # fmt: skip
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"unknown event tag {str(tag)[:40]!r}")


def _block_stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(_value(f["block_hashes"]))
    parent = _decoded(f, "parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise KVEventDecodeError("BlockStored.parent_block_hash must be an integer, bytes or null")
    tokens = _value(f["token_ids"])
    try:
        array(_UINT32, tokens)  # checks every id in C: an integer in [0, 2**32)
    except (TypeError, OverflowError):
        raise KVEventDecodeError("BlockStored.token_ids must be an array of integers in [0, 2**32)") from None
    if not isinstance(tokens, list):
        raise KVEventDecodeError("BlockStored.token_ids must be an array of integers in [0, 2**32)")
    block_size = _value(f["block_size"])
    if not _is_int(block_size) or block_size < 1:
        raise KVEventDecodeError(f"BlockStored.block_size must be an integer >= 1, got {block_size!r}"[:120])
    if len(tokens) != len(hashes) * block_size:
        raise KVEventDecodeError(
            f"BlockStored has {len(hashes)} blocks of {block_size} tokens but {len(tokens)} token ids"
        )
    extra = _decoded(f, "extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or not all(k is None or isinstance(k, list) for k in extra):
            raise KVEventDecodeError("BlockStored.extra_keys must be an array of arrays or nulls")
        extra = tuple(None if k is None else tuple(_freeze(x) for x in k) for k in extra)
    lora_id = _decoded(f, "lora_id")
    if lora_id is not None and not _is_int(lora_id):
        raise KVEventDecodeError("BlockStored.lora_id must be an integer or null")
    return BlockStored(
        hashes, parent, tuple(tokens), block_size, lora_id, _opt_str(_decoded(f, "medium"), "medium"),
        _opt_str(_decoded(f, "lora_name"), "lora_name"), extra, _opt_int(_decoded(f, "group_idx"), "group_idx"),
        _opt_str(_decoded(f, "cache_salt"), "cache_salt"),
    )  # fmt: skip


def _is_hash(value: object) -> bool:
    return _is_int(value) or isinstance(value, bytes)


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise KVEventDecodeError("block_hashes must be an array of integers or bytes")
    return tuple(value)


def _opt_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise KVEventDecodeError(f"{name} must be a string or null, got {type(value).__name__}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    if value is not None and not _is_int(value):
        raise KVEventDecodeError(f"{name} must be an integer or null, got {type(value).__name__}")
    return value


def _freeze(value: Any) -> Any:
    """msgpack arrays as tuples, so that extra keys are hashable and comparable."""
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _encode_event(event: KVCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}
