"""The model runner's model: `load_model(source, dtype, device, quantization)` and `load_tokenizer(source)` for any
`kvroute.model_source.ModelSource` (GGUF file, HF directory, or the tiny random model); with a `quantization`, the
linear layers and the embedding are weight-only int8 / int4 (worker/model/weight_quantization.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvkernels.weight_only import QuantizedWeight
from kvroute.model_source import ModelSource
from kvroute.tokenizer import Tokenizer
from worker.model.config import LlamaConfig
from worker.model.gguf_loader import iter_gguf_weights, open_gguf
from worker.model.hf_loader import iter_hf_weights, read_hf_config
from worker.model.llama import LlamaForCausalLM
from worker.model.tiny import tiny_config, tiny_weights
from worker.model.weight_quantization import WeightQuantization, build_quantized_model

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["LlamaConfig", "LlamaForCausalLM", "WeightQuantization", "build_model", "load_model", "load_tokenizer"]


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: WeightQuantization | None = None,
) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """The model in eval mode with weights in `dtype` on `device` (the quantized layers' activations in `dtype`),
    and its config. A GGUF's Q8_0 / Q4_0 / Q4_1 blocks reach a quantized model as they are."""
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    if source.kind == "gguf" and source.path is not None:
        reader, config = open_gguf(source.path)
        weights = iter_gguf_weights(reader, config, keep_blocks=quantization is not None)
    elif source.kind == "hf" and source.path is not None:
        config = read_hf_config(source.path)
        weights = iter_hf_weights(source.path)
    elif source.kind == "tiny":
        config = tiny_config()
        weights = tiny_weights(config).items()
    else:
        raise ValueError(f"model kind {source.kind!r} has no weights to load")
    if quantization is not None:
        _check_dtype(dtype)
        return build_quantized_model(config, weights, quantization, dtype, device), config
    return build_model(config, weights, dtype, device), config  # type: ignore[arg-type]  # float: no blocks kept


def build_model(
    config: LlamaConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Allocate the model without initialising it (meta device), then fill it from HF-named `weights`."""
    _check_dtype(dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.model.rotary_emb.reset_cache()
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval().requires_grad_(False)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"model dtype must be float32 or bfloat16, got {dtype}")


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The model's tokenizer; `tiny` and `sim` use SmolLM2's."""
    return Tokenizer.for_model(source)
