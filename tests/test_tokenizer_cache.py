"""The tokenizer's memory of text runs (`encode_chat(cache_scope=...)`): every prompt gets exactly the ids a
whole encode gives, whatever was remembered before; a prompt that starts with remembered runs tokenizes only
its new ones; scopes never share; the budget holds, and 0 turns it off."""

from __future__ import annotations

import random

import pytest

from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer

# Pieces that a byte-level BPE merges, or splits, in ways that depend on what is next to them: runs of spaces
# and newlines, digits (SmolLM2 splits each), contractions, punctuation, multi-byte characters, and pieces of
# the template's own special tokens.
PIECES = [
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " \n",
    "a",
    "the",
    " the",
    "The",
    "bike",
    "'s",
    "'ll",
    "1",
    "12",
    "2024",
    " 7",
    ".",
    "...",
    ",",
    "!",
    "?",
    "-",
    "--",
    "(",
    ")",
    "{",
    '"',
    "é",
    "中文",
    "🚲",
    "e\u0301",
    "\u00a0",
    "<",
    "|",
    "<|",
    "|>",
    "im",
    "_start",
    "<|im_",
    "end|>",
    "im_end",
    "\u0080",
    "\ufdd0",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n"]
ROLES = ["system", "user", "assistant"]


def random_text(rng: random.Random, specials: bool) -> str:
    pieces = [rng.choice(PIECES) for _ in range(rng.randrange(0, 40))]
    if specials and rng.random() < 0.5:
        pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(SPECIALS))
    return "".join(pieces)


def random_conversation(rng: random.Random, specials: bool) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": random_text(rng, specials)}] if rng.random() < 0.5 else []
    for k in range(rng.randrange(1, 7)):
        turns.append({"role": ROLES[1 + k % 2], "content": random_text(rng, specials)})
    return turns


def fresh(base: Tokenizer, template: str | None = None) -> Tokenizer:
    return Tokenizer(base.backend, template or base.chat_template, base.bos_token_id, base.eos_token_ids)


@pytest.fixture(scope="module", params=["smollm2", "sim"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return Tokenizer.for_model(resolve_model(request.param))


# A template whose user text touches the special tokens on both sides, with nothing of its own in between.
TIGHT = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.mark.parametrize("template", [None, TIGHT], ids=["model", "tight"])
def test_remembered_runs_give_exactly_the_ids_of_a_whole_encode(tokenizer: Tokenizer, template: str | None) -> None:
    """Many random conversations, each sent turn by turn (every prefix of it, as a client continuing it does),
    interleaved in one scope so that remembered runs turn up in other conversations and other places: each
    prompt's ids equal those without the memory, and, where no message spells a special token, the library's
    own encode of the whole rendered text."""
    t = fresh(tokenizer, template)
    rng = random.Random(23)
    conversations = [random_conversation(rng, specials=i % 3 == 0) for i in range(120)]
    sent = 0
    for step in range(7):
        for conversation in conversations:
            messages = conversation[: step + 1]
            if step and len(conversation) <= step:
                continue
            expected = t.encode_chat(messages)
            assert t.encode_chat(messages, cache_scope="tenant") == expected, messages
            if not any(special in m["content"] for m in messages for special in SPECIALS + ["<|endoftext|>"]):
                assert expected == t.encode(t.apply_chat_template(messages)), messages
            sent += 1
    assert sent > 300 and t.run_cache_usage.entries > 100


def test_a_continued_conversation_tokenizes_only_its_new_runs(tokenizer: Tokenizer) -> None:
    t = fresh(tokenizer)
    turns = [{"role": "system", "content": "You help with bicycles."}]
    for k in range(12):
        turns.append({"role": "user", "content": f"Turn {k}: is the chain too loose?"})
        t.encode_chat(turns, cache_scope="a")
        before = t.run_cache_usage.entries
        turns.append({"role": "assistant", "content": f"Answer {k}: tighten it by 2 mm."})
        turns.append({"role": "user", "content": f"And then {k}?"})
        assert t.encode_chat(turns, cache_scope="a") == t.encode(t.apply_chat_template(turns))
        assert t.run_cache_usage.entries == before + 2  # the two new turns; the rest came from memory
        turns.pop()


def test_scopes_never_share_and_a_budget_of_zero_keeps_nothing(tokenizer: Tokenizer) -> None:
    t = fresh(tokenizer)
    messages = [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "hi"}]
    plain = t.encode_chat(messages)
    assert t.run_cache_usage.entries == 0  # no scope, no memory
    assert t.encode_chat(messages, cache_scope="tenant-a") == plain
    one_scope = t.run_cache_usage.entries
    assert t.encode_chat(messages, cache_scope="tenant-a") == plain
    assert t.run_cache_usage.entries == one_scope
    assert t.encode_chat(messages, cache_scope="tenant-b") == plain
    assert t.run_cache_usage.entries == 2 * one_scope  # tenant-b found none of tenant-a's
    t.limit_run_cache(0)
    assert t.run_cache_usage.entries == 0
    assert t.encode_chat(messages, cache_scope="tenant-a") == plain
    assert t.run_cache_usage == (0, 0, 0)


def test_the_budget_holds_over_many_short_runs(tokenizer: Tokenizer) -> None:
    t = fresh(tokenizer)
    budget = 32 * 1024
    t.limit_run_cache(budget)
    rng = random.Random(5)
    for _ in range(300):
        messages = random_conversation(rng, specials=False)
        assert t.encode_chat(messages, cache_scope="a") == t.encode_chat(messages)
        assert t.run_cache_usage.bytes <= budget
    assert 20 < t.run_cache_usage.entries < 300
