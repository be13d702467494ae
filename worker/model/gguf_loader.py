"""Loading a Llama-architecture model from a GGUF file: config from the metadata, weights dequantised to float.

llama.cpp's converter permutes the rows of Q and K for `llama` models so that its kernels can apply RoPE to
adjacent pairs (interleaved). This model uses HF's rotate-half RoPE, so the permutation is undone here:
per head, rows (2, head_dim/2) were stored as (head_dim/2, 2). `qwen2` files are converted without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from kvroute.gguf_file import GGUFFile, gguf_field, read_gguf
from worker.model.config import LlamaConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf_config(reader: GGUFFile) -> LlamaConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with per-frequency RoPE factors (rope_freqs, Llama 3.1+) are not supported")
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (none, linear)")
    return LlamaConfig(
        vocab_size=int(gguf_field(reader, f"{arch}.vocab_size", len(gguf_field(reader, "tokenizer.ggml.tokens")))),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
    )


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows (n_head, head_dim/2, 2) -> (n_head, 2, head_dim/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(reader: GGUFFile, config: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor, dequantised one at a time."""
    permuted = gguf_field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost first
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)
        if permuted and ".attn_q." in tensor.name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif permuted and ".attn_k." in tensor.name:
            w = unpermute_qk(w, config.num_key_value_heads)
        yield hf_name(tensor.name), torch.from_numpy(np.require(w, requirements=["C", "W"]))


def open_gguf(path: Path) -> tuple[GGUFFile, LlamaConfig]:
    reader = read_gguf(path)
    return reader, read_gguf_config(reader)
