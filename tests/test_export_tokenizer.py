"""`kvroute export-tokenizer` (issue 20, item 7): SmolLM2's tokenizer written out of its GGUF as an HF folder
loads back in transformers, in `tokenizers` and in kvroute itself with the same ids, the same chat rendering
and the same fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.model_source import smollm2_gguf_path
from kvroute.tokenizer import Tokenizer
from launch.cli import main

TEXTS = [
    "Hello, world!",
    "Digits split one by one: 1234567890 and 3.14159, -42, 1e10.",
    "Unicode: élan, naïve, 漢字, русский, emoji 🚀👩‍💻, combining é.",
    "  leading spaces,\ttabs,\n\nnewlines and trailing   ",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "<repo_name>kvroute<file_sep>README.md",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "2 + 2 = ?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 12345 * 678? Ünïcödé 漢字"},
    ],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    assert main(["export-tokenizer", "--model", "smollm2", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_the_exported_folder_tokenizes_as_kvroute_does_in_transformers_and_tokenizers(exported: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import tokenizers

    ours = Tokenizer.from_gguf(smollm2_gguf_path())
    assert sorted(p.name for p in exported.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(str(exported))
    raw = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
    assert hf.bos_token == "<|im_start|>" and hf.eos_token == "<|im_end|>" and hf.model_max_length == 8192
    for text in TEXTS:
        expected = ours.encode(text, add_special_tokens=True)
        assert hf.encode(text) == expected, text
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
        assert raw.encode(text).ids == expected, text
        assert hf.decode(expected) == ours.decode(expected, skip_special_tokens=False), text
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert rendered == ours.apply_chat_template(messages, add_generation_prompt)
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert list(ids) == ours.encode_chat(messages, add_generation_prompt)
    assert Tokenizer.from_hf_dir(exported).fingerprint == ours.fingerprint


def test_an_export_never_overwrites_without_force(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (exported / "tokenizer_config.json").read_bytes()
    assert main(["export-tokenizer", "--model", "smollm2", "--out", str(exported)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export-tokenizer", "--model", "no-such-model", "--out", str(exported / "x")]) == 2
    assert main(["export-tokenizer", "--model", "smollm2", "--out", str(exported), "--force"]) == 0
    assert (exported / "tokenizer_config.json").read_bytes() == before
