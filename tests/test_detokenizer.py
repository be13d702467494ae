"""The byte-level detokenizer's table lookups give exactly the deltas of the library's `DecodeStream`
(`StreamDetokenizer`, the general path), and so exactly the library's `decode` of the whole stream."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as HFTokenizer

from kvroute.model_source import resolve_model
from kvroute.tokenizer import ByteLevelDetokenizer, StreamDetokenizer, Tokenizer

# Added tokens spelled in the byte-level alphabet ("Ā" is byte 0, "Ġ" a space), outside it (a space, "é", "�"),
# and one that is a lone continuation byte's spelling.
ADDED = ["ĀĀzzq", " x y", "né\ufffd", "Ġhiq", "\x80", "<|tool|>"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    sim = Tokenizer.for_model(resolve_model("sim"))
    hf_dir = tmp_path_factory.mktemp("hf")
    sim.save_hf_dir(hf_dir)
    backend = HFTokenizer.from_str(sim.backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED[:-2]])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED[-2:]])
    added = Tokenizer(backend, sim.chat_template, sim.bos_token_id, sim.eos_token_ids)
    return {"sim (SmolLM2's)": sim, "hf dir": Tokenizer.from_hf_dir(hf_dir), "added tokens": added}


def deltas(detokenizer: StreamDetokenizer | ByteLevelDetokenizer, chunks: list[Sequence[int]]) -> list[str]:
    return [detokenizer.add(chunk) for chunk in chunks] + [detokenizer.flush()]


def assert_same_deltas(tokenizer: Tokenizer, chunks: list[Sequence[int]]) -> None:
    for skip in (True, False):
        fast = tokenizer.incremental_detokenizer(skip)
        assert isinstance(fast, ByteLevelDetokenizer)
        got = deltas(fast, chunks)
        assert got == deltas(StreamDetokenizer(tokenizer, skip), chunks), (chunks, skip)
        ids = [i for chunk in chunks for i in chunk]
        assert "".join(got) == tokenizer.decode(ids, skip_special_tokens=skip)


def random_chunks(rng: random.Random, ids: list[int]) -> list[Sequence[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([0, 1, 1, 2, 3, 5, 20])
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def single_byte_ids(tokenizer: Tokenizer) -> dict[int, int]:
    """byte -> the id of a token that is that byte alone (235 of the 256 bytes have one in SmolLM2's vocab)."""
    table = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return {b[0]: i for i, b in enumerate(table) if len(b) == 1 and i not in tokenizer.special_token_ids}


def awkward_ids(tokenizer: Tokenizer) -> dict[str, list[int]]:
    """Ids of tokens whose bytes are one byte, a broken character, or hold U+FFFD itself; the special ones."""
    table = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return {
        "single": list(single_byte_ids(tokenizer).values()),
        "replacement": [i for i, b in enumerate(table) if b"\xef\xbf\xbd" in b],
        "special": sorted(tokenizer.special_token_ids),
        "multibyte": [i for i, b in enumerate(table) if any(c >= 0x80 for c in b)][:400],
    }


@pytest.mark.parametrize("name", ["sim (SmolLM2's)", "hf dir", "added tokens"])
def test_random_streams_give_the_library_decodes_deltas(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tokenizer = tokenizers[name]
    rng = random.Random(23)
    pools = awkward_ids(tokenizer)
    text = "<|im_start|>emoji 🎉🤖👨\u200d👩\u200d👧 naïve 日本語 12345 done<|im_end|> ok"
    for _ in range(150):
        kind = rng.choice(["vocab", "awkward", "text"])
        if kind == "vocab":
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        elif kind == "awkward":
            pool = [i for ids in pools.values() for i in ids]
            ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids = ids[rng.randrange(len(ids)) :]
        assert_same_deltas(tokenizer, random_chunks(rng, ids))


@pytest.mark.parametrize("name", ["sim (SmolLM2's)", "added tokens"])
def test_adversarial_streams_cut_at_every_point(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tokenizer = tokenizers[name]
    pools = awkward_ids(tokenizer)
    single = single_byte_ids(tokenizer)
    four_bytes = [single[b] for b in "🎉".encode()]
    streams = [
        four_bytes + [single[ord("a")]] + four_bytes[:2] + four_bytes,  # a character broken off by another
        [single[0xE2], single[0x82], pools["special"][0], single[0xAC], single[ord("!")]],  # a special inside
        [single[b] for b in (0xED, 0xA0, 0x80, 0xE0, 0x80, 0xF4, 0x90, 0x80, 0x80, 0xC3, 0x41, 0xF3)],
        [single[0xF0], single[0x9F], single[0x8E], *pools["replacement"][:2], single[ord("x")], single[0xE2]],
        [pools["replacement"][0], single[ord("z")], pools["replacement"][0]],
    ]
    if name == "added tokens":
        streams.append([tokenizer.backend.token_to_id(t) for t in ADDED] + four_bytes[:3] + [single[0x80]])
    for ids in streams:
        assert_same_deltas(tokenizer, [ids])
        assert_same_deltas(tokenizer, [[i] for i in ids])
        for cut in range(len(ids) + 1):
            assert_same_deltas(tokenizer, [ids[:cut], ids[cut:]])
            for second in range(cut, len(ids) + 1):
                assert_same_deltas(tokenizer, [ids[:cut], ids[cut:second], [], ids[second:]])


def test_unknown_ids_stand_for_nothing(tokenizers: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers["sim (SmolLM2's)"]
    ids = [*tokenizer.encode("hé"), tokenizer.vocab_size + 7, *tokenizer.encode("llo")]
    assert_same_deltas(tokenizer, [ids[:2], ids[2:]])


def test_a_decoder_that_is_not_plain_byte_level_keeps_the_library_path(
    tokenizers: dict[str, Tokenizer], tmp_path: Path
) -> None:
    sim = tokenizers["sim (SmolLM2's)"]
    backend = HFTokenizer.from_str(sim.backend.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    other = Tokenizer(backend, sim.chat_template, sim.bos_token_id, sim.eos_token_ids)
    detokenizer = other.incremental_detokenizer()
    assert isinstance(detokenizer, StreamDetokenizer)
    broken_tail = [single_byte_ids(other)[b] for b in "🎉".encode()[:3]]
    ids = other.encode(" hello 🎉 world") + broken_tail
    for cut in range(len(ids) + 1):
        for skip in (True, False):
            got = deltas(other.incremental_detokenizer(skip), [ids[:cut], ids[cut:]])
            assert "".join(got) == other.decode(ids, skip_special_tokens=skip), (cut, got)
            assert got[-1].endswith("\ufffd")  # the broken tail, given out by flush
