"""`--dtype auto` picks bfloat16 only where the machine multiplies it natively, and the engine says which dtype
and attention path it took, and why (startup log, GetInfo, engine_bench).

Each CPU's branch runs here: the detection reads /proc/cpuinfo through kvkernels.cpu_backend.cpu_flags, whose
KVROUTE_CPU_HIDE_FLAGS switch hides this machine's features; other architectures' flag sets are given to the
same detection."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

import kvkernels.cpu_backend as cpu_backend
from kvkernels.cpu_backend import HIDE_FLAGS_ENV, cpu_flags, native_bf16, unsupported_reason
from proto import worker_pb2, worker_pb2_grpc
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.model.packed_linear import DECODE_ROWS, Bf16DecodeLinear, bf16_decode_weights_supported
from worker.model_runner import resolve_dtype
from worker.service import start_worker_server

HIDE_BF16 = "avx512_bf16,amx_bf16"


def float32_attention_path() -> str:
    """What a float32 model's attention says on this CPU: the AVX2 float32 kernel where no AVX-512 makes SDPA
    faster, the torch path elsewhere."""
    skipped = cpu_backend.fp32_kernel_skipped_reason()
    if skipped is None:
        return "cpu: C++ AVX2 float32 paged attention kernel"
    return f"cpu: torch path (a float32 model; {skipped})"


NO_BF16_REASON = "auto: float32, the CPU has no native bf16 (no avx512_bf16/amx_bf16)"
# ... on an x86 CPU with AVX2 and FMA, whose decode steps read bf16 copies of the weights (worker/model/packed_linear)
AVX2_REASON = NO_BF16_REASON + f"; steps of <= {DECODE_ROWS} tokens read bfloat16 copies of the linear weights"
needs_native_bf16 = pytest.mark.skipif(not native_bf16()[0], reason="this CPU has no native bf16 to hide")


def pretend_cpu(monkeypatch: pytest.MonkeyPatch, machine: str, flags: set[str]) -> None:
    monkeypatch.setattr(cpu_backend, "_proc_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_backend.platform, "machine", lambda: machine)
    monkeypatch.delenv(HIDE_FLAGS_ENV, raising=False)


@pytest.mark.parametrize(
    ("machine", "flags", "dtype", "reason"),
    [
        ("x86_64", {"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, "natively (avx512_bf16)"),
        ("x86_64", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, "(avx512_bf16/amx_bf16)"),
        ("x86_64", {"avx2", "amx_bf16"}, torch.bfloat16, "natively (amx_bf16)"),
        ("x86_64", {"avx2", "fma", "avx512f"}, torch.float32, AVX2_REASON),  # AVX-512 without BF16
        ("x86_64", {"avx2", "fma"}, torch.float32, AVX2_REASON),  # an AVX2-only Zen 3
        ("x86_64", {"sse4_2"}, torch.float32, NO_BF16_REASON),  # no AVX2: no bf16 decode weights either
        ("aarch64", {"asimd", "sve", "bf16", "svebf16"}, torch.bfloat16, "natively (bf16)"),  # Graviton 3
        ("aarch64", {"asimd", "atomics"}, torch.float32, "no native bf16 (no bf16)"),  # Graviton 2
        ("riscv64", {"rv64"}, torch.float32, "no bf16 instructions known for riscv64"),
    ],
)
def test_auto_picks_bfloat16_only_with_native_bf16(monkeypatch, machine, flags, dtype, reason) -> None:
    pretend_cpu(monkeypatch, machine, flags)
    choice = resolve_dtype("auto", "gguf", "cpu")
    assert choice.dtype == dtype
    assert choice.reason == reason if reason.startswith("auto:") else reason in choice.reason
    assert choice.reason.startswith(f"auto: {str(dtype).removeprefix('torch.')}")


def test_explicit_dtypes_and_the_tiny_model(monkeypatch) -> None:
    pretend_cpu(monkeypatch, "x86_64", {"avx2"})
    assert resolve_dtype("float32", "gguf") == (torch.float32, "float32 as asked")
    emulated = resolve_dtype("bfloat16", "gguf")
    assert emulated.dtype == torch.bfloat16 and "no avx512_bf16/amx_bf16: torch emulates it" in emulated.reason
    pretend_cpu(monkeypatch, "x86_64", {"avx2", "avx512_bf16"})
    assert resolve_dtype("bfloat16", "gguf") == (torch.bfloat16, "bfloat16 as asked")
    assert resolve_dtype("auto", "tiny").dtype == torch.float32  # its own dtype, whatever the CPU


def test_hide_switch_removes_flags_from_every_check(monkeypatch) -> None:
    present = sorted(cpu_backend._proc_cpu_flags())
    if not present:
        pytest.skip("no /proc/cpuinfo flags here")
    monkeypatch.setenv(HIDE_FLAGS_ENV, f"{present[0]}, {present[-1]}")
    assert present[0] not in cpu_flags() and present[-1] not in cpu_flags()
    assert set(present[1:-1]) <= cpu_flags()
    monkeypatch.setenv(HIDE_FLAGS_ENV, "avx512_bf16")
    if platform_is_x86():
        assert unsupported_reason() == lacks_for_bf16_kernel()


def lacks_for_bf16_kernel() -> str:
    """What the bf16 kernel's check says on this CPU with the hidden flags: every flag it needs that is missing,
    avx512_bf16 among them (an AVX2-only CPU lacks the AVX-512 base flags too)."""
    missing = [flag for flag in cpu_backend.REQUIRED_FLAGS if flag not in cpu_flags()]
    assert "avx512_bf16" in missing
    return f"the CPU lacks {', '.join(missing)}"


def platform_is_x86() -> bool:
    return cpu_backend.platform.machine() in ("x86_64", "AMD64")


@needs_native_bf16
def test_hiding_bf16_here_takes_the_float32_branch(monkeypatch, caplog) -> None:
    assert resolve_dtype("auto", "gguf").dtype == torch.bfloat16
    assert LLMEngine(EngineConfig(model="sim")).dtype == torch.bfloat16
    monkeypatch.setenv(HIDE_FLAGS_ENV, HIDE_BF16)
    assert resolve_dtype("auto", "gguf") == (torch.float32, AVX2_REASON)
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        engine = LLMEngine(EngineConfig(model="sim"))
    assert engine.dtype == torch.float32 and engine.dtype_reason == AVX2_REASON
    assert f"dtype torch.float32 ({AVX2_REASON}); attention none (sim: no model)" in caplog.text


def test_auto_and_float32_engines_in_one_process_keep_their_own_weights(monkeypatch) -> None:
    """On a CPU without native bf16, `auto` adds bf16 decode copies to its model in place; an explicit float32
    engine in the same process (the benchmark's reference, the reference tests) must not run on them."""
    monkeypatch.setenv(HIDE_FLAGS_ENV, HIDE_BF16)
    if reason := bf16_decode_weights_supported():
        pytest.skip(f"bf16 decode weights: {reason}")
    auto = LLMEngine(EngineConfig(model="smollm2", num_kv_blocks=16))
    fp32 = LLMEngine(EngineConfig(model="smollm2", dtype="float32", num_kv_blocks=16))
    assert auto.runner.bf16_decode_weights and not fp32.runner.bf16_decode_weights
    assert auto.runner.model is not fp32.runner.model
    assert not any(isinstance(m, Bf16DecodeLinear) for m in fp32.runner.model.modules())


def test_attention_path_is_named_with_its_reason(monkeypatch) -> None:
    fields = dict(model="tiny", num_kv_blocks=16)
    fp32 = LLMEngine(EngineConfig(**fields, dtype="float32"))
    assert fp32.attention_backend == float32_attention_path()
    assert LLMEngine(EngineConfig(**fields, attention_backend="torch")).attention_backend == "torch"
    if platform_is_x86():
        monkeypatch.setenv(HIDE_FLAGS_ENV, HIDE_BF16)
        hidden = LLMEngine(EngineConfig(**fields, dtype="bfloat16"))
        assert hidden.attention_backend == f"cpu: torch path ({lacks_for_bf16_kernel()})"
        assert not hidden.runner.backend.runs_kernel(
            torch.zeros(1, 4, 32, dtype=torch.bfloat16), hidden.runner.kv_caches[0][0]
        )
        assert "emulates" in hidden.dtype_reason


@pytest.mark.skipif(unsupported_reason() is not None, reason=f"{unsupported_reason()}")
def test_bf16_model_on_a_bf16_cpu_names_the_kernel() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="bfloat16", num_kv_blocks=16))
    assert engine.attention_backend == "cpu: C++ AVX-512 BF16 paged attention kernel"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_is_bfloat16_where_supported() -> None:
    choice = resolve_dtype("auto", "gguf", "cuda")
    assert choice.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)
    assert torch.cuda.get_device_name() in choice.reason


def test_get_info_says_which_dtype_and_attention_path_and_why() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=16))

    async def main() -> worker_pb2.WorkerInfo:
        server = await start_worker_server(engine, port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        finally:
            await server.stop(0)

    info = asyncio.run(main())
    assert info.dtype == "float32" and info.dtype_reason == "auto: float32, the tiny test model's own dtype"
    assert info.attention_backend == float32_attention_path()
