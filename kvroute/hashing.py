"""Chained block hashes: the one truth that gateway (routing), worker (prefix cache) and replay share.

A prompt of n tokens has n // block_size full blocks; only full blocks are hashed.

    root = H(b"kvroute-block-hash-v1", model_id, cache_salt)
    h[0] = H(root,   tokens[0:B])
    h[i] = H(h[i-1], tokens[i*B:(i+1)*B])

H is BLAKE2b with a 128-bit digest. Token ids are serialised as fixed-width little-endian uint32, so the
bytes (and the hashes) are the same on every machine. Because each hash covers its parent, equal hashes
mean equal whole prefixes, and a cache can be keyed by the hash alone. The root mixes in the model and
the tenant's cache salt: equal text from two tenants or two models never matches.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
DEFAULT_BLOCK_SIZE = 16
HASH_BYTES = 16
HASH_VERSION = b"kvroute-block-hash-v1"
HASHED_TOKEN_IDS = 2**32  # token ids are hashed as uint32: [0, HASHED_TOKEN_IDS), any other is refused
# A fresh BLAKE2b-128 state; copying it is cheaper than the constructor's keyword parsing, which matters at
# one call per block (256 for a 4,096-token prompt, on every routing decision).
_EMPTY = hashlib.blake2b(digest_size=HASH_BYTES)
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


def _digest(data: bytes | memoryview) -> BlockHash:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


@functools.lru_cache(maxsize=1024)  # one per (model, tenant salt) in use; every prompt's hashing starts here
def root_hash(model_id: str, cache_salt: str = "") -> BlockHash:
    """The parent of a sequence's first block, for one model and one tenant salt."""
    model = model_id.encode()
    salt = cache_salt.encode()
    # Length-prefixed fields, so ("ab", "c") and ("a", "bc") never collide.
    payload = HASH_VERSION + struct.pack("<I", len(model)) + model + struct.pack("<I", len(salt)) + salt
    return _digest(payload)


def serialize_tokens(tokens: Sequence[int]) -> bytes:
    """Fixed-width little-endian uint32 encoding of token ids."""
    encoded = array(_UINT32)
    try:
        if isinstance(tokens, list):
            encoded.fromlist(tokens)  # about twice as fast as converting through the iterator protocol
        else:
            encoded.extend(tokens)
    except (TypeError, OverflowError) as exc:
        bad = next((t for t in tokens if not (isinstance(t, int) and 0 <= t < HASHED_TOKEN_IDS)), None)
        raise ValueError(f"token id {bad!r} is not an integer in [0, 2**32)") from exc
    if _SWAP:
        encoded.byteswap()
    return encoded.tobytes()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The hash of one block given its parent's hash."""
    return _digest(parent + serialize_tokens(tokens))


def block_hashes(
    tokens: Sequence[int],
    *,
    model_id: str,
    cache_salt: str = "",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[BlockHash]:
    """The chained hashes of every full block of `tokens` (a trailing partial block is not hashed)."""
    return extend_block_hashes(root_hash(model_id, cache_salt), tokens, block_size)


def extend_block_hashes(parent: BlockHash, tokens: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens`, chained onto `parent` (the root or the last known block)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(tokens) // block_size
    try:
        data = serialize_tokens(tokens)  # the trailing partial block's few ids too: cheaper than a copy without them
    except ValueError:  # perhaps an id of the partial block, which is not hashed: refuse only one of a full block
        data = serialize_tokens(tokens[: num_full * block_size])
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    append, fresh = hashes.append, _EMPTY.copy
    for block in [data[i : i + stride] for i in range(0, num_full * stride, stride)]:
        h = fresh()  # H(parent || block) fed in two updates: no concatenated copy per block
        h.update(parent)
        h.update(block)
        parent = h.digest()
        append(parent)
    return hashes


class BlockHasher:
    """Incremental hashes for a sequence that grows token by token (the worker's view of one request).
    `hashes`: its leading full blocks' hashes, when already computed by this same function (copied)."""

    def __init__(
        self,
        model_id: str,
        cache_salt: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
        hashes: Sequence[BlockHash] = (),
    ) -> None:
        self.block_size = block_size
        self.root = root_hash(model_id, cache_salt)
        self.hashes: list[BlockHash] = list(hashes)

    def update(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Hash every full block of `tokens` (the whole sequence so far) not hashed yet; returns the new ones."""
        done = len(self.hashes) * self.block_size
        if len(tokens) < done + self.block_size:  # no new full block: the common case, called every step
            return []
        parent = self.hashes[-1] if self.hashes else self.root
        new = extend_block_hashes(parent, tokens[done:] if done else tokens, self.block_size)  # no copy of a prompt
        self.hashes.extend(new)
        return new

    def truncate(self, num_blocks: int) -> None:
        """Forget every hash past the first `num_blocks` (the sequence was cut back)."""
        del self.hashes[num_blocks:]


def hash_fingerprint(model_id: str, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """Hex hash of the first block of tokens 0..block_size-1 with no salt: equal on a gateway and a worker
    only if they agree on hash version, model id and block size (published by the worker, checked by
    gateways; DESIGN §7 hash parity)."""
    return block_hashes(range(block_size), model_id=model_id, block_size=block_size)[0].hex()
