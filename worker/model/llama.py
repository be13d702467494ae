"""A Llama-architecture decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) over a paged
KV cache.

The model sees one engine step as a flat batch of T new tokens from any number of sequences. Attention goes
through an `AttentionBackend` (kvkernels/attention.py): the layer writes the step's K/V into the cache, then
the backend attends over each sequence's cached context using `AttentionMetadata`.

Weights arrive under HF names (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, ...) and are stacked
into `qkv_proj` and `gate_up_proj` on load, as in vLLM: one matmul instead of three (or two); what that saves:
docs/worker.md, "Where the CPU time goes".

Float32 activations on an x86 CPU with AVX2 take the small ops fused (kvkernels/cpu_fused_ops.py): RMSNorm with
the residual add before it, SiLU(gate) * up and RoPE, each one pass instead of 2 to 6 torch ops. The residual
stream therefore runs beside the hidden states, as in vLLM: each norm adds the layer's output to it first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvkernels import cpu_fused_ops
from worker.model.config import LlamaConfig

if TYPE_CHECKING:
    from kvkernels.attention import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class OutputRows:
    """The rows of a step whose hidden states the caller wants (those it samples from). Only the last layer
    narrows to them: it still writes every row's K/V to the cache (later steps read them), then attends, projects
    and runs its MLP for these rows alone, which spares a prefill about 1 / num_layers of its work."""

    rows: torch.Tensor  # int64 [N]: rows of the step's flat batch, in the order wanted
    meta: AttentionMetadata | None  # the rows as one-token queries over their seqs' contexts; None iff N = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual stream, (norm(x + residual), x + residual). The fused path computes in place
        and returns x and residual themselves, so callers pass tensors that nothing else reads."""
        if residual is not None and cpu_fused_ops.available(x):
            cpu_fused_ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = x + residual
            return self.norm(residual), residual
        return self.norm(x)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_fused_ops.available(x):
            return cpu_fused_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and cast back before the weight, as HF does, so bf16 matches it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] with the model's theta and scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_freq_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout) with a float32 cos/sin table for every position up to the maximum."""

    cos_sin_cache: torch.Tensor  # a registered buffer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_sin_cache", self._build_cache(), persistent=False)

    def _build_cache(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim / 2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, head_dim]

    def reset_cache(self) -> None:
        """Recompute the table in place (after the module was materialised from the meta device)."""
        self.cos_sin_cache = self._build_cache().to(self.cos_sin_cache.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for broadcasting over heads."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, head_dim / 2] each
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos, sin

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """The rotation of one step's tokens: x [T, n_heads, head_dim] -> x rotated (in place where fused)."""
        if dtype == torch.float32 and cpu_fused_ops.available(self.cos_sin_cache):
            return lambda x: _rope_in_place(x, self.cos_sin_cache, positions)
        cos, sin = self.cos_sin(positions, dtype)
        return lambda x: apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, n_heads, head_dim]; rotate_half(x) = cat(-x2, x1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rope_in_place(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cpu_fused_ops.rope_(x, cos_sin, positions)
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # Per-tensor FP8 KV scales (contract: stored = x / scale); 1.0 unless the engine calibrates them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,
        rope: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output: OutputRows | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], or [N, hidden] for `output`'s rows (their meta must not be None)."""
        q = self.write_kv(x, rope, kv_cache, meta, backend)
        if output is not None:
            assert output.meta is not None, "LlamaDecoderLayer only writes K/V when no row is wanted"
            q, meta = q[output.rows], output.meta
        k_cache, v_cache = kv_cache
        out = backend.attend(q, k_cache, v_cache, meta, self.scaling, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(q.shape[0], self.q_size))

    def write_kv(
        self,
        x: torch.Tensor,
        rope: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Write every row's rotated K and V into the cache; returns the rotated q [T, n_heads, head_dim]."""
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotate as one tensor of n_heads + n_kv_heads heads: half the small ops of a decode step's RoPE.
        qk = rope(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, n_heads | n_kv_heads, head_dim]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return q


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_fused_ops.available(gate_up):
            return self.down_proj(cpu_fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, the residual stream before it), [T, hidden] each, or [N, hidden] for `output`'s
        rows (every row's K/V written either way). The stream is input + output in HF's terms, added by the next
        norm; the first layer's stream is its input."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if output is not None and output.meta is None:  # no row wanted: only this layer's K/V are
            self.self_attn.write_kv(h, rope, kv_cache, meta, backend)
            return h[:0], residual[:0]
        h = self.self_attn(h, rope, kv_cache, meta, backend, output)
        if output is not None:
            residual = residual[output.rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (stacked parameter, shard index): q/k/v and gate/up load into fused matrices.
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output: OutputRows | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden_size] (final norm applied), or with
        `output` [N, hidden_size] for its rows alone; the KV cache is filled for all T rows either way."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.model.rotary_emb.at(positions, h.dtype)
        residual = None
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            h, residual = layer(h, residual, rope, kv_cache, meta, backend, output if i == last else None)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the parameters, casting
        to their dtype. Raises ValueError naming the tensor on an unknown name or a wrong shape, and naming
        the gaps when a parameter (or a q/k/v, gate/up shard of a fused one) is left unfilled. A tied
        lm_head.weight is ignored."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = self._stacked_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for this model")
            self._copy_shard(param.data, tensor, target, shard, name)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in range(max(1, len(self._shard_sizes(n))))}
        if missing := sorted(expected - loaded):
            raise ValueError(f"missing weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters under HF checkpoint names, fused matrices split back: `load_weights`'s inverse,
        e.g. to rebuild the model in another dtype or save it as an HF directory."""
        for name, param in self.named_parameters():
            if not self._shard_sizes(name):
                yield name, param
                continue
            for hf_name, (stacked, shard) in self.stacked_params.items():
                if stacked in name:
                    yield name.replace(stacked, hf_name), param[self._shard_rows(name, shard)]

    def _stacked_target(self, name: str) -> tuple[str, int]:
        for hf_name, (stacked, shard) in self.stacked_params.items():
            if f".{hf_name}." in name:
                return name.replace(hf_name, stacked), shard
        return name, 0

    def _shard_sizes(self, param_name: str) -> list[int]:
        """Row counts of the HF matrices stacked into a fused parameter; [] for a plain one."""
        c = self.config
        if "qkv_proj" in param_name:
            return [c.q_size, c.kv_size, c.kv_size]
        if "gate_up_proj" in param_name:
            return [c.intermediate_size, c.intermediate_size]
        return []

    def _shard_rows(self, param_name: str, shard: int) -> slice | None:
        sizes = self._shard_sizes(param_name)
        if not sizes:
            return None
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def _copy_shard(self, param: torch.Tensor, tensor: torch.Tensor, target: str, shard: int, name: str) -> None:
        rows = self._shard_rows(target, shard)
        dest = param if rows is None else param[rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
