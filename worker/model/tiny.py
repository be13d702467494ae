"""A tiny Llama with deterministic random weights, for tests that need a real model but not a real one's cost.

The vocabulary is SmolLM2's (49152), so text encoded with SmolLM2's tokenizer round-trips through it.
`write_hf_dir` saves any config + weights as an HF model directory that transformers can load, which is how
tests compare this model with the reference implementation on identical weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvroute.tokenizer import Tokenizer
from worker.model.config import LlamaConfig

TINY_SEED = 0


def tiny_config(**overrides: Any) -> LlamaConfig:
    """hidden 128, 2 layers, 4 heads / 2 KV heads of 32, SmolLM2's vocabulary; any field can be overridden."""
    fields: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**(fields | overrides))


def tiny_weights(config: LlamaConfig, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """HF-named float32 weights drawn from a seeded generator: the same tensors on every machine.

    Matrices have std 1/sqrt(fan_in), so activations keep their scale through the layers and the logits
    spread out (std ~1) instead of sitting near a uniform distribution full of ties."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    c = config
    weights = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=gen)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(c.hidden_size),
            p + "self_attn.q_proj.weight": matrix(c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": matrix(c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": matrix(c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": matrix(c.hidden_size, c.q_size),
            p + "post_attention_layernorm.weight": norm(c.hidden_size),
            p + "mlp.gate_proj.weight": matrix(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": matrix(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": matrix(c.hidden_size, c.intermediate_size),
        }
        if c.qkv_bias:
            for name, size in (("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)):
                weights[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(size, generator=gen)
        if c.o_bias:
            weights[p + "self_attn.o_proj.bias"] = 0.1 * torch.randn(c.hidden_size, generator=gen)
    weights["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(c.vocab_size, c.hidden_size)
    return weights


def hf_config_dict(config: LlamaConfig, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """config.json for transformers: Qwen2 when only q/k/v carry biases, Llama otherwise."""
    qwen2 = config.qkv_bias and not config.o_bias
    fields = dataclasses.asdict(config)
    for ours in ("qkv_bias", "o_bias"):
        del fields[ours]
    return fields | {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "hidden_act": "silu",
        "attention_bias": config.o_bias,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.bos_token_id if tokenizer else None,
        "eos_token_id": tokenizer.eos_token_ids[0] if tokenizer and tokenizer.eos_token_ids else None,
    }


def write_hf_dir(
    directory: Path, config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None = None
) -> Path:
    """Save as an HF model directory (config.json, model.safetensors and, given a tokenizer,
    tokenizer.json + tokenizer_config.json with its chat template)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config, tokenizer), indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.backend.save(str(directory / "tokenizer.json"))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "chat_template": tokenizer.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory
