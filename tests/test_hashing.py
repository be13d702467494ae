import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.hashing import (
    HASH_BYTES,
    BlockHasher,
    block_hashes,
    hash_block,
    root_hash,
    serialize_tokens,
)

# Pinned vectors: changing them changes every cache key in a deployed fleet (gateway and workers must agree).
ROOT_M = "0db48608316630766580862b757b4ebb"
ROOT_M_TENANT_A = "cb0ac39a601287273623686c1b53ee5b"
SMOLLM2_0_TO_39 = ["935aed2673a6c86dc5e77e6b26f3a370", "2e75bb5541404d874978f7304fae3bea"]
ZEROS_SALTED = ["0f561408d862f4b23a1fafdd59ce2444", "bb53549690186cba741269639577622b"]


def test_pinned_vectors():
    assert root_hash("m").hex() == ROOT_M
    assert root_hash("m", "tenant-a").hex() == ROOT_M_TENANT_A
    assert [h.hex() for h in block_hashes(list(range(40)), model_id="smollm2")] == SMOLLM2_0_TO_39
    assert [h.hex() for h in block_hashes([0] * 32, model_id="m", cache_salt="s")] == ZEROS_SALTED


def test_definition_from_first_principles():
    """The spec of DESIGN §2, rebuilt by hand with hashlib: BLAKE2b-128, length-prefixed root, uint32 LE."""
    root = hashlib.blake2b(
        b"kvroute-block-hash-v1" + (7).to_bytes(4, "little") + b"smollm2" + (0).to_bytes(4, "little"),
        digest_size=16,
    ).digest()
    tokens = list(range(16))
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    h0 = hashlib.blake2b(root + data, digest_size=16).digest()
    assert root_hash("smollm2") == root
    assert block_hashes(tokens, model_id="smollm2") == [h0]


def test_the_library_digests_have_at_least_128_bits():
    """DESIGN §2: a 64-bit hash is too easy to collide on purpose across tenants."""
    assert HASH_BYTES * 8 >= 128
    digests = [root_hash("m", "salt"), hash_block(root_hash("m"), [1, 2]), *block_hashes(list(range(48)), model_id="m")]
    assert [len(d) for d in digests] == [HASH_BYTES] * 5
    assert len(BlockHasher("m").root) == HASH_BYTES


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), model_id="m") == []
    assert len(block_hashes(list(range(16)), model_id="m")) == 1
    assert len(block_hashes(list(range(47)), model_id="m")) == 2
    assert len(block_hashes(list(range(64)), model_id="m", block_size=32)) == 2


def test_chaining_makes_a_hash_depend_on_the_whole_prefix():
    a = block_hashes([1] * 16 + [2] * 16, model_id="m")
    b = block_hashes([3] * 16 + [2] * 16, model_id="m")
    assert a[1] != b[1]  # same second block, different first block


def test_salt_and_model_isolate():
    tokens = list(range(32))
    assert block_hashes(tokens, model_id="m", cache_salt="a") != block_hashes(tokens, model_id="m", cache_salt="b")
    assert block_hashes(tokens, model_id="m1") != block_hashes(tokens, model_id="m2")
    # length prefixes: moving a character between model id and salt changes the root
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_bad_token_ids_are_refused():
    with pytest.raises(ValueError, match="token id -1"):
        serialize_tokens([1, -1])
    with pytest.raises(ValueError, match="token id -1"):
        block_hashes([1] * 15 + [-1] + [2], model_id="m")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1] * 16, model_id="m", block_size=0)


def test_a_trailing_partial_block_is_not_read():
    assert block_hashes([1] * 16 + [-1, 2**40], model_id="m") == block_hashes([1] * 16, model_id="m")


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 20))
def test_incremental_hasher_matches_one_shot(tokens, block_size):
    hasher = BlockHasher("m", "salt", block_size)
    for end in range(0, len(tokens) + 1, 7):
        hasher.update(tokens[:end])
    hasher.update(tokens)
    assert hasher.hashes == block_hashes(tokens, model_id="m", cache_salt="salt", block_size=block_size)
    if hasher.hashes:
        parent = hasher.hashes[-2] if len(hasher.hashes) > 1 else hasher.root
        last = tokens[(len(hasher.hashes) - 1) * block_size : len(hasher.hashes) * block_size]
        assert hash_block(parent, last) == hasher.hashes[-1]


def test_truncate_then_rehash():
    tokens = list(range(64))
    hasher = BlockHasher("m")
    hasher.update(tokens)
    hasher.truncate(2)
    assert hasher.update(tokens[:48] + [9] * 16)[1] == block_hashes(tokens[:48] + [9] * 16, model_id="m")[3]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=100), st.integers(1, 20), st.text(max_size=8))
def test_fast_path_matches_the_definition(tokens, block_size, salt):
    """The hashing loop (array serialisation, copied BLAKE2b states) gives exactly H(parent || uint32 LE block)."""
    parent = root_hash("m", salt)
    expected = []
    for i in range(len(tokens) // block_size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        expected.append(parent)
    assert block_hashes(tokens, model_id="m", cache_salt=salt, block_size=block_size) == expected
