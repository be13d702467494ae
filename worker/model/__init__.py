"""The model runner's model: `load_model(source, dtype, device)` and `load_tokenizer(source)` for any
`kvroute.model_source.ModelSource` (GGUF file, HF directory, or the tiny random model)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvroute.model_source import ModelSource
from kvroute.tokenizer import Tokenizer
from worker.model.config import LlamaConfig
from worker.model.gguf_loader import iter_gguf_weights, open_gguf
from worker.model.hf_loader import iter_hf_weights, read_hf_config
from worker.model.llama import LlamaForCausalLM
from worker.model.tiny import tiny_config, tiny_weights

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["LlamaConfig", "LlamaForCausalLM", "build_model", "load_model", "load_tokenizer"]


def load_model(
    source: ModelSource, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """The model in eval mode with weights in `dtype` on `device`, and its config."""
    if source.kind == "gguf" and source.path is not None:
        reader, config = open_gguf(source.path)
        weights: Iterable[tuple[str, torch.Tensor]] = iter_gguf_weights(reader, config)
    elif source.kind == "hf" and source.path is not None:
        config = read_hf_config(source.path)
        weights = iter_hf_weights(source.path)
    elif source.kind == "tiny":
        config = tiny_config()
        weights = tiny_weights(config).items()
    else:
        raise ValueError(f"model kind {source.kind!r} has no weights to load")
    return build_model(config, weights, dtype, device), config


def build_model(
    config: LlamaConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Allocate the model without initialising it (meta device), then fill it from HF-named `weights`."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"model dtype must be float32 or bfloat16, got {dtype}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.model.rotary_emb.reset_cache()
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval().requires_grad_(False)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The model's tokenizer; `tiny` and `sim` use SmolLM2's."""
    return Tokenizer.for_model(source)
