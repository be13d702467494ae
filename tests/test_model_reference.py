"""The Llama model against HF transformers on identical weights: the tiny random model (every loader feature),
and SmolLM2-135M from its GGUF (dequantised by both sides). Also: the paged cache gives the same logits
whether a prompt runs in one step, in chunks over a cached prefix, or batched with another sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvkernels.attention import AttentionBackend, AttentionMetadata
from kvkernels.backend_select import get_attention_backend
from kvroute.model_source import ModelSource, resolve_model
from kvroute.tokenizer import Tokenizer
from worker.model import LlamaConfig, LlamaForCausalLM, build_model, load_model, load_tokenizer
from worker.model.tiny import tiny_config, tiny_weights, write_hf_dir

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16

TINY_VARIANTS = {
    "llama": {},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "qwen2-bias-tied": {"qkv_bias": True, "tie_word_embeddings": True, "rope_theta": 1e6},
}

REAL_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant who answers with short code samples."},
        {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, iteratively."},
    ],
    [
        {
            "role": "user",
            "content": "Summarise this: The Industrial Revolution began in Great Britain in the late 18th "
            "century and spread to Europe and North America. It replaced hand production with machines, new "
            "chemical and iron processes, steam power and the factory system. Average incomes and population "
            "grew as never before, while cities swelled and working conditions were often harsh.",
        }
    ],
    [{"role": "user", "content": "List three prime numbers greater than 100 and explain why 12345 is not prime."}],
    [
        {
            "role": "user",
            "content": "What does this function do, and what is its complexity?\n\n"
            "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
            "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
            "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
        }
    ],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as in tests/test_engine_reference.py: with two, every parallel op waits for a core
    whenever the machine is shared (under pytest -n or beside other jobs), spinning while it waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PagedKV:
    """KV caches for one or more sequences, with each sequence's blocks allocated in order."""

    def __init__(self, config: LlamaConfig, num_blocks: int, dtype: torch.dtype) -> None:
        shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        self.caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)
        ]
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}

    def table_for(self, seq: int, seq_len: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK_SIZE < seq_len:
            table.append(self.next_block)
            self.next_block += 1
        return table


def run_step(
    model: LlamaForCausalLM,
    kv: PagedKV,
    backend: AttentionBackend,
    chunks: list[tuple[int, list[int], int]],
) -> torch.Tensor:
    """One engine step over (seq id, new token ids, tokens already cached) chunks -> logits [T, vocab]."""
    ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
    for seq, new_ids, cached in chunks:
        ids += new_ids
        positions += range(cached, cached + len(new_ids))
        query_lens.append(len(new_ids))
        seq_lens.append(cached + len(new_ids))
        tables.append(kv.table_for(seq, cached + len(new_ids)))
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    hidden = model(torch.tensor(ids), torch.tensor(positions), kv.caches, meta, backend)
    return model.compute_logits(hidden)


def prompt_logits(model: LlamaForCausalLM, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    kv = PagedKV(model.config, -(-len(ids) // BLOCK_SIZE), dtype)
    return run_step(model, kv, get_attention_backend("torch", "cpu"), [(0, ids, 0)])


def greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos_token_id: int = 2) -> list[int]:
    """Prefill, then one decode step per token over the paged cache; stops after EOS as `generate` does."""
    kv = PagedKV(model.config, -(-(len(prompt) + max_new_tokens) // BLOCK_SIZE), torch.float32)
    backend = get_attention_backend("torch", "cpu")
    logits = run_step(model, kv, backend, [(0, prompt, 0)])
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        logits = run_step(model, kv, backend, [(0, out[-1:], len(prompt) + len(out) - 1)])
        out.append(int(logits[-1].argmax()))
    return out


def reference_greedy(ref, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def report_diff(label: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (ours - ref).abs().max().item()
    print(f"\n{label}: max |logit diff| = {diff:.3g} (max |logit| {ref.abs().max().item():.3g})")
    return diff


# ---- tiny model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_tiny_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_smollm2: Tokenizer) -> dict[str, Path]:
    dirs = {}
    for name, overrides in TINY_VARIANTS.items():
        config = tiny_config(**overrides)
        dirs[name] = write_hf_dir(tmp_path_factory.mktemp(name), config, tiny_weights(config), tokenizer_smollm2)
    return dirs


@pytest.fixture(scope="module")
def model_tiny_prompt(tokenizer_smollm2: Tokenizer) -> list[int]:
    text = tokenizer_smollm2.apply_chat_template(REAL_PROMPTS[2])
    return tokenizer_smollm2.encode(text)


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_logits_match_transformers(
    variant: str, model_tiny_dirs: dict[str, Path], model_tiny_prompt: list[int]
) -> None:
    source = resolve_model(str(model_tiny_dirs[variant]))
    model, config = load_model(source, torch.float32)
    assert config == tiny_config(**TINY_VARIANTS[variant])
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_tiny_dirs[variant], dtype=torch.float32)
    with torch.no_grad():
        expected = ref(torch.tensor([model_tiny_prompt])).logits[0]
    diff = report_diff(f"tiny/{variant}", prompt_logits(model, model_tiny_prompt), expected)
    assert diff < 1e-3


def test_tiny_greedy_matches_transformers_generate(
    model_tiny_dirs: dict[str, Path], model_tiny_prompt: list[int]
) -> None:
    model, _ = load_model(resolve_model("tiny"), torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_tiny_dirs["llama"], dtype=torch.float32)
    prompt = model_tiny_prompt[:40]
    tokens = greedy(model, prompt, 64)
    assert len(tokens) == 64
    assert tokens == reference_greedy(ref, prompt, 64)


def test_tiny_source_is_the_written_hf_dir(model_tiny_dirs: dict[str, Path]) -> None:
    tiny, config = load_model(resolve_model("tiny"), torch.float32)
    from_dir, _ = load_model(resolve_model(str(model_tiny_dirs["llama"])), torch.float32)
    for (name, a), (_, b) in zip(tiny.state_dict().items(), from_dir.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    expected = tiny_weights(config)
    for name, tensor in tiny.named_hf_weights():
        assert torch.equal(tensor, expected.pop(name)), name
    assert not expected


def test_chunked_and_batched_steps_match_one_full_step(model_tiny_prompt: list[int]) -> None:
    model, config = load_model(resolve_model("tiny"), torch.float32)
    prompt_a, prompt_b = model_tiny_prompt[:45], model_tiny_prompt[10:40]
    full_a, full_b = prompt_logits(model, prompt_a), prompt_logits(model, prompt_b)

    kv = PagedKV(config, 8, torch.float32)
    backend = get_attention_backend("torch", "cpu")
    first = run_step(model, kv, backend, [(0, prompt_a[:20], 0)])  # a chunk ending mid-block
    # Next step: the rest of seq 0 over its cached prefix, batched with all of seq 1.
    rest = run_step(model, kv, backend, [(1, prompt_b, 0), (0, prompt_a[20:], 20)])
    torch.testing.assert_close(first, full_a[:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest[: len(prompt_b)], full_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest[len(prompt_b) :], full_a[20:], atol=1e-4, rtol=1e-4)


def test_tied_embedding_is_one_tensor() -> None:
    config = tiny_config(tie_word_embeddings=True, num_hidden_layers=1)
    model = build_model(config, tiny_weights(config).items(), torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_missing_and_misshapen_weights_are_named() -> None:
    config = tiny_config(num_hidden_layers=1)
    weights = tiny_weights(config)
    partial = {k: v for k, v in weights.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="missing weights: model.layers.0.self_attn.qkv_proj.weight#1"):
        build_model(config, partial.items())
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        build_model(config, weights.items())


def test_resolve_model_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="is not one of"):
        resolve_model("no-such-model")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(fake))


def test_model_ids_are_stable_and_distinct(model_tiny_dirs: dict[str, Path], model_smollm2_source: ModelSource) -> None:
    ids = {name: resolve_model(str(d)).model_id for name, d in model_tiny_dirs.items()}
    assert len(set(ids.values())) == len(ids)
    assert resolve_model(str(model_tiny_dirs["llama"])).model_id == ids["llama"]
    assert model_smollm2_source.model_id == resolve_model(str(model_smollm2_source.path)).model_id
    assert model_smollm2_source.model_id.startswith("SmolLM2-135M-Instruct")
    assert resolve_model("tiny").model_id != resolve_model("sim").model_id


# ---- SmolLM2 ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_smollm2(model_smollm2_source: ModelSource) -> LlamaForCausalLM:
    return load_model(model_smollm2_source, torch.float32)[0]


@pytest.fixture(scope="module")
def model_smollm2_prompts(tokenizer_smollm2: Tokenizer) -> list[list[int]]:
    return [tokenizer_smollm2.encode(tokenizer_smollm2.apply_chat_template(m)) for m in REAL_PROMPTS]


@pytest.mark.slow
def test_smollm2_config_from_gguf(model_smollm2: LlamaForCausalLM) -> None:
    c = model_smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.rope_theta, c.vocab_size, c.tie_word_embeddings) == (64, 100000.0, 49152, True)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(
    model_smollm2: LlamaForCausalLM, model_smollm2_reference, model_smollm2_prompts: list[list[int]]
) -> None:
    ids = model_smollm2_prompts[2]
    with torch.no_grad():
        expected = model_smollm2_reference(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model_smollm2, ids)
    assert report_diff("smollm2 fp32", ours, expected) < 2e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_generate(
    model_smollm2: LlamaForCausalLM, model_smollm2_reference, model_smollm2_prompts: list[list[int]]
) -> None:
    prompt = model_smollm2_prompts[1]  # asks for code: a long answer, no early EOS
    tokens = greedy(model_smollm2, prompt, 64)
    assert len(tokens) == 64
    assert tokens == reference_greedy(model_smollm2_reference, prompt, 64)


@pytest.mark.slow
def test_smollm2_bf16_quality(model_smollm2: LlamaForCausalLM, model_smollm2_prompts: list[list[int]]) -> None:
    """Teacher-forced over every position of real prompts: bf16's next-token choice and distribution vs fp32."""
    # The same rounding of the same float32 weights as load_model(source, torch.bfloat16), without reloading.
    bf16 = build_model(model_smollm2.config, model_smollm2.named_hf_weights(), torch.bfloat16)
    agree, kl, positions = 0, 0.0, 0
    for ids in model_smollm2_prompts:
        ref_logp = torch.log_softmax(prompt_logits(model_smollm2, ids), dim=-1)
        logp = torch.log_softmax(prompt_logits(bf16, ids, torch.bfloat16), dim=-1)
        agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        positions += len(ids)
    print(
        f"\nsmollm2 bf16 vs fp32 over {positions} positions: top-1 agreement {agree / positions:.4f}, "
        f"mean KL {kl / positions:.3g} nats"
    )
    assert positions >= 200
    assert agree / positions >= 0.9
    assert kl / positions < 0.05


def test_load_tokenizer_for_every_kind(model_tiny_dirs: dict[str, Path], tokenizer_smollm2: Tokenizer) -> None:
    for spec in ("sim", str(model_tiny_dirs["llama"])):
        assert load_tokenizer(resolve_model(spec)).fingerprint == tokenizer_smollm2.fingerprint
