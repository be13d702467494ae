"""Building a model whose linear layers and embedding are weight-only int8 or int4 (`--weights int8|int4`):
every nn.Linear becomes a `QuantizedLinear` and the embedding a `QuantizedEmbedding` (worker/model/quantized_linear.py),
each filled from the weights as they stream in, so no float copy of a quantized layer is ever allocated.

Where each layer's `QuantizedWeight` comes from (`to_quantized`):
- a GGUF's own Q8_0 / Q4_0 / Q4_1 blocks (worker/model/gguf_loader.py), group 32: kept when the bits match;
  a 4-bit block asked for int8 is widened exactly (same q, scales and offsets); a Q8_0 block asked for int4 stays
  int8 unless a group size was asked (then it is requantized: int4 from 8-bit blocks loses what the file kept);
  a group size other than 32 asked requantizes any block from its exact float values;
- float weights (F32/F16 GGUF tensors, HF directories, the tiny model): `kvkernels.weight_only.quantize` with the
  group size asked, else the largest of 128, 64 and 32 that divides every layer's input features.
The shards stacked into one layer (q/k/v, gate/up) must agree in bits and group size: any that do not are
requantized to the asked bits at the smallest group size among them. Norms and biases stay in the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvkernels.weight_only import GROUP_SIZES, QuantizedWeight, dequantize, quantize
from worker.model.config import LlamaConfig
from worker.model.llama import LlamaForCausalLM
from worker.model.quantized_linear import QuantizedEmbedding, QuantizedLinear, weight_only_backend

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens"


@dataclass(frozen=True)
class WeightQuantization:
    bits: int  # 8 or 4
    group_size: int | None  # inputs per scale; None: the source's own blocks where they map, else the largest fit
    symmetric: bool  # for float weights quantized here; a GGUF block keeps its own scheme

    @classmethod
    def from_flags(cls, weights: str, group_size: int | None, scheme: str) -> WeightQuantization | None:
        """`--weights` int8 / int4 with `--weight-group-size` and `--weight-scheme`; None for auto and float
        (every weight in the model's dtype)."""
        if weights in ("auto", "float"):
            return None
        if weights not in ("int8", "int4"):
            raise ValueError(f"weights must be one of auto, float, int8, int4; got {weights!r}")
        return cls(8 if weights == "int8" else 4, group_size, scheme == "sym")


def largest_group_size(in_features: dict[str, int]) -> int:
    """The largest of GROUP_SIZES dividing every layer's input features (`in_features`: layer name -> K)."""
    for group in sorted(GROUP_SIZES, reverse=True):
        if all(k % group == 0 for k in in_features.values()):
            return group
    odd = next(name for name, k in in_features.items() if k % min(GROUP_SIZES))
    raise ValueError(f"no weight group size ({GROUP_SIZES}) divides {odd}'s {in_features[odd]} input features")


def check_group_size(group_size: int, in_features: dict[str, int]) -> None:
    """ValueError naming the first layer whose input features `group_size` does not divide."""
    for name, k in in_features.items():
        if k % group_size:
            raise ValueError(
                f"--weight-group-size {group_size} does not divide {name}'s {k} input features; "
                f"choose one of {', '.join(str(g) for g in GROUP_SIZES if k % g == 0) or 'none'}, or leave it unset"
            )


def to_quantized(
    weight: torch.Tensor | QuantizedWeight, asked: WeightQuantization, float_group: int
) -> QuantizedWeight:
    """The layer's weight in the asked format, by the rules in the module docstring."""
    if isinstance(weight, torch.Tensor):
        return quantize(weight, asked.bits, float_group, asked.symmetric)
    if asked.group_size is not None and asked.group_size != weight.group_size:
        return quantize(dequantize(weight), asked.bits, asked.group_size, asked.symmetric)
    if weight.bits == asked.bits or (asked.group_size is None and weight.bits == 8):
        return weight
    if weight.bits == 4:  # 0..15 fits int8: the same numbers
        return QuantizedWeight(8, weight.group_size, weight.q.to(torch.int8), weight.scales, weight.offsets)
    return quantize(dequantize(weight), asked.bits, weight.group_size, asked.symmetric)


def stack_shards(shards: list[QuantizedWeight], asked: WeightQuantization) -> QuantizedWeight:
    """The shards' rows as one weight (q/k/v into qkv_proj, gate/up into gate_up_proj)."""
    formats = {(s.bits, s.group_size) for s in shards}
    if len(formats) > 1:
        group = min(g for _, g in formats)
        shards = [
            s if (s.bits, s.group_size) == (asked.bits, group) else to_quantized(dequantize(s), asked, group)
            for s in shards
        ]
    first = shards[0]
    return QuantizedWeight(
        first.bits,
        first.group_size,
        torch.cat([s.q for s in shards]),
        torch.cat([s.scales for s in shards]),
        torch.cat([s.offsets for s in shards]),
    )


def _on(weight: QuantizedWeight, device: torch.device | str) -> QuantizedWeight:
    move = {name: getattr(weight, name).to(device) for name in ("q", "scales", "offsets")}
    return QuantizedWeight(weight.bits, weight.group_size, **move)


def build_quantized_model(
    config: LlamaConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    asked: WeightQuantization,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LlamaForCausalLM:
    """The model with its linear layers and embedding quantized as `asked` (norms and biases in `dtype`).
    ValueError before loading when the group size asked does not divide a layer, naming it."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layers: dict[str, nn.Linear | nn.Embedding] = {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)
    }
    if config.tie_word_embeddings:
        del layers["lm_head"]
    in_features = {name: m.in_features if isinstance(m, nn.Linear) else m.embedding_dim for name, m in layers.items()}
    if asked.group_size is not None:
        check_group_size(asked.group_size, in_features)
    float_group = asked.group_size or largest_group_size(in_features)
    for m in layers.values():
        m.weight = None  # type: ignore[assignment]  # filled quantized below, never allocated in float
    model.lm_head.weight = None  # type: ignore[assignment]  # tied or not, a QuantizedLinear below
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.reset_cache()

    num_shards = Counter(stacked for stacked, _ in LlamaForCausalLM.stacked_params.values())
    shards: dict[str, dict[int, QuantizedWeight]] = defaultdict(dict)
    origins: Counter[str] = Counter()

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        """The weights that stay float; the quantized ones go to `shards`."""
        for name, weight in weights:
            layer, shard = _layer_and_shard(name)
            if layer == "lm_head" and config.tie_word_embeddings:
                continue
            if name.endswith(".weight") and layer in layers:
                quantized = to_quantized(weight, asked, float_group)
                origins[_origin(weight, quantized)] += 1
                shards[layer][shard] = quantized
            elif isinstance(weight, QuantizedWeight):
                yield name, dequantize(weight)
            else:
                yield name, weight

    with torch.no_grad():
        model.load_weights(others())
    backend = weight_only_backend(device)
    for layer, module in layers.items():
        got = shards.get(layer, {})
        expected = num_shards.get(layer.rpartition(".")[2], 1)
        if len(got) != expected:
            raise ValueError(f"missing weights: {layer} has {len(got)} of its {expected} matrices")
        weight = _on(stack_shards([got[i] for i in range(expected)], asked), device)
        if isinstance(module, nn.Embedding):
            want: tuple[int, int] = (module.num_embeddings, module.embedding_dim)
        else:
            want = (module.out_features, module.in_features)
        if weight.shape != want:
            raise ValueError(f"weight {layer!r} has shape {weight.shape}, expected {want}")
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(module, nn.Embedding):
            setattr(parent, child, QuantizedEmbedding(backend.module.pack(weight), backend.module, dtype))
        else:
            bias = None if module.bias is None else module.bias.data
            setattr(parent, child, QuantizedLinear.from_weight(weight, backend.module, bias))
    if config.tie_word_embeddings:
        embedding = model.model.embed_tokens
        assert isinstance(embedding, QuantizedEmbedding)
        model.lm_head = embedding.tied_linear()  # type: ignore[assignment]
    log.info(
        "weights %s: %s; %s (%s)",
        f"int{asked.bits}",
        ", ".join(f"{n} {what}" for what, n in sorted(origins.items())),
        backend.name,
        backend.reason,
    )
    return model.eval().requires_grad_(False)


def _layer_and_shard(name: str) -> tuple[str, int]:
    """`model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj`, 1)."""
    stem = name.rpartition(".")[0]
    head, _, leaf = stem.rpartition(".")
    if leaf in LlamaForCausalLM.stacked_params:
        stacked, shard = LlamaForCausalLM.stacked_params[leaf]
        return f"{head}.{stacked}", shard
    return stem, 0


def _origin(source: torch.Tensor | QuantizedWeight, result: QuantizedWeight) -> str:
    """How one matrix was made, for the start-up line, e.g. "int4 blocks kept (g32)"."""
    target = f"int{result.bits} g{result.group_size}"
    if isinstance(source, torch.Tensor):
        return f"float matrices quantized to {target}"
    if (source.bits, source.group_size) == (result.bits, result.group_size):
        return f"GGUF int{source.bits} blocks kept as {target}"
    return f"GGUF int{source.bits} blocks as {target}"


def describe_weights(model: nn.Module) -> str:
    """The model's weight formats, e.g. "int4 g32 x 210, int8 g32 x 1 (embedding + tied lm_head)", or "float"."""
    formats: Counter[str] = Counter()
    backends = set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            formats[f"int{module.bits} g{module.group_size}"] += 1
            backends.add(module.backend.__name__.rpartition(".")[2])
    if not formats:
        return "float"
    return f"{', '.join(f'{f} x {n}' for f, n in formats.most_common())} on {', '.join(sorted(backends))}"
