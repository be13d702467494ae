"""Loading a Llama-architecture model from an HF directory: config.json + *.safetensors.

Supported `model_type`s: llama, mistral, qwen2 (q/k/v biases). Sliding-window attention is not implemented;
a model that declares a window gets `max_position_embeddings` capped at it, where full attention is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.model.config import LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_hf_config(directory: Path) -> LlamaConfig:
    cfg: dict[str, Any] = json.loads((directory / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    num_heads = cfg["num_attention_heads"]
    # transformers 5 writes `rope_parameters` (theta included); older files `rope_theta` + `rope_scaling`.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_positions = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
    attention_bias = bool(cfg.get("attention_bias", False))
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=min(max_positions, window) if window else max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
    )


def iter_hf_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the directory's safetensors files, one at a time."""
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                yield name, f.get_tensor(name)
