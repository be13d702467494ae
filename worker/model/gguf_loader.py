"""Loading a Llama-architecture model from a GGUF file: config from the metadata, weights dequantised to float,
or, for weight-only quantized layers, Q8_0 / Q4_0 / Q4_1 blocks unpacked into kvkernels' `QuantizedWeight`
as they are (`gguf_quantized_weight`: no float round trip).

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

from kvkernels.weight_only import QuantizedWeight
from kvroute.gguf_file import GGUFFile, GGUFTensor, gguf_field, read_gguf
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


# The block-quantised types that are a QuantizedWeight as stored: 32 inputs a block, one float16 scale each
# (and Q4_1 a float16 minimum), so a block is a group of 32.
QUANTIZED_TYPES = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
BLOCK_SIZE = 32


def gguf_quantized_weight(tensor: GGUFTensor) -> QuantizedWeight | None:
    """A Q8_0, Q4_0 or Q4_1 matrix as a QuantizedWeight of group 32 holding its blocks' own numbers (dequantize
    gives gguf-py's dequantisation exactly); None for any other type. Rows as stored (no Q/K unpermutation).
    Q8_0: int8 q, scales d, offsets 0. Q4_0: q in 0..15, value d * (q - 8): scales d, offsets -8 d (exact in
    float16). Q4_1: value d * q + m: scales d, offsets m. A 4-bit block keeps inputs 0..15 in its 16 bytes' low
    nibbles and 16..31 in their high ones."""
    if tensor.tensor_type not in QUANTIZED_TYPES or len(tensor.shape) != 2:
        return None
    n, k = tensor.shape[1], tensor.shape[0]  # GGUF lists dims innermost first
    _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = tensor.data.reshape(n, k // BLOCK_SIZE, type_size)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return _weight(8, q, scales, np.zeros_like(scales))
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0:
        offsets, packed = (scales.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]
    else:
        offsets, packed = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0], blocks[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)
    return _weight(4, q, scales, offsets)


def _weight(bits: int, q: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> QuantizedWeight:
    tensors = (torch.from_numpy(np.array(a, copy=True)) for a in (q, scales, offsets))
    return QuantizedWeight(bits, BLOCK_SIZE, *tensors)


def unpermute_qk_weight(weight: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """`unpermute_qk` on a quantized weight: groups run along the inputs, so the row permutation moves q's,
    scales' and offsets' rows alike."""
    rows = torch.from_numpy(unpermute_qk(np.arange(weight.shape[0]), n_head))
    return QuantizedWeight(weight.bits, weight.group_size, weight.q[rows], weight.scales[rows], weight.offsets[rows])


def iter_gguf_weights(
    reader: GGUFFile, config: LlamaConfig, keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor) for every tensor, dequantised one at a time; with `keep_blocks`, the Q8_0, Q4_0
    and Q4_1 matrices as QuantizedWeights of their own blocks instead (`gguf_quantized_weight`)."""
    permuted = gguf_field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        n_head = None
        if permuted and ".attn_q." in tensor.name:
            n_head = config.num_attention_heads
        elif permuted and ".attn_k." in tensor.name:
            n_head = config.num_key_value_heads
        blocks = gguf_quantized_weight(tensor) if keep_blocks else None
        if blocks is not None:
            yield hf_name(tensor.name), blocks if n_head is None else unpermute_qk_weight(blocks, n_head)
            continue
        shape = tuple(reversed(tensor.shape))
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32, copy=False)
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        yield hf_name(tensor.name), torch.from_numpy(np.require(w, requirements=["C", "W"]))


def open_gguf(path: Path) -> tuple[GGUFFile, LlamaConfig]:
    reader = read_gguf(path)
    return reader, read_gguf_config(reader)
