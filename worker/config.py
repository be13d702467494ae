"""The engine's configuration: one dataclass, validated once, read by every part of the worker."""

from __future__ import annotations

from dataclasses import dataclass

from kvkernels.backend_select import BACKEND_NAMES as ATTENTION_BACKENDS
from kvkernels.weight_only import GROUP_SIZES

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
# float: every weight in the model's dtype (today's path); int8 / int4: linear layers and the embedding weight-only
# quantized (kvkernels/weight_only.py), from the GGUF's own blocks where the format maps, else by per-group
# quantization of the float weights (worker/model/quantized_linear.py); auto: float.
WEIGHTS = ("auto", "float", "int8", "int4")
WEIGHT_SCHEMES = ("sym", "asym")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy names (worker/scheduler.py)


@dataclass
class EngineConfig:
    model: str = "tiny"  # tiny | smollm2 | sim | path (kvroute.model_source.resolve_model)
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: see worker.model_runner.resolve_dtype)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, half the bytes of bf16)
    weights: str = "auto"  # auto | float | int8 | int4 (WEIGHTS)
    # Inputs per scale when float weights are quantized (32, 64 or 128); None: the GGUF's own block (32) where
    # its format maps, else 128.
    weight_group_size: int | None = None
    weight_scheme: str = "asym"  # sym | asym, when float weights are quantized
    attention_backend: str = "auto"  # auto | torch | cpu | triton (kvkernels.backend_select.get_attention_backend)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # The host tier (worker/host_kv_tier.py): blocks, or a size in GiB (one or the other); 0: none.
    host_kv_blocks: int = 0
    host_kv_memory_gb: float = 0.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked prefill token budget per step (vLLM's CPU server default)
    watermark: float = 0.01  # share of blocks kept free when admitting
    # Blocks kept free for each running sequence's growth when admitting: its prompt's rest and up to this many
    # decode tokens (worker/scheduler.py, "Headroom"; the default's measured trade in docs/worker.md); 0: the
    # watermark only.
    decode_reserve_tokens: int = 32
    # fcfs: waiting requests in arrival order; priority: by (priority, arrival), a more urgent request preempting
    # less urgent running ones when it does not fit (worker/scheduler.py, "Priority")
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's
    device: str = "cpu"
    seed: int = 0
    # --model sim only: time spent per step, by the replay's cost model
    sim_prefill_us_per_token: float = 32.0
    sim_decode_ms_per_step: float = 20.0
    # A sim block's copy between the device and the host tier: its notional 2 MiB at 31.5 GB/s, seed 004's
    # swap of 1.07 GB in 34 ms over PCIe.
    sim_host_copy_us_per_block: float = 67.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("weights", self.weights, WEIGHTS)
        _check_choice("weight_scheme", self.weight_scheme, WEIGHT_SCHEMES)
        if self.weight_group_size is not None and self.weight_group_size not in GROUP_SIZES:
            raise ValueError(
                f"weight_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.weight_group_size}"
            )
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be >= 0, got {self.decode_reserve_tokens}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.sim_prefill_us_per_token < 0 or self.sim_decode_ms_per_step < 0 or self.sim_host_copy_us_per_block < 0:
            raise ValueError(
                "sim_prefill_us_per_token, sim_decode_ms_per_step, sim_host_copy_us_per_block must be >= 0"
            )
        if self.host_kv_blocks < 0 or self.host_kv_memory_gb < 0:
            raise ValueError("host_kv_blocks and host_kv_memory_gb must be >= 0")
        if self.host_kv_blocks and self.host_kv_memory_gb:
            raise ValueError("give the host KV tier's size as host_kv_blocks or host_kv_memory_gb, not both")
        if (self.host_kv_blocks or self.host_kv_memory_gb) and not self.enable_prefix_caching:
            raise ValueError("a host KV tier keeps cached blocks by their hashes: it needs prefix caching")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
