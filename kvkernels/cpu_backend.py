"""The engine's attention backend on CPUs, with two C++ kernels over the torch path they extend:
- bfloat16 models on CPUs with AVX-512 BF16 run every step through cpu_attention.cpp;
- float32 models on x86 CPUs with AVX2 and FMA but no AVX-512 (where `auto` picks float32 for want of native bf16)
  run every step through cpu_attention_fp32.cpp;
- everything else (ARM, older x86, float32 on AVX-512 CPUs, where SDPA's AVX-512 code is faster) runs torch's.

What each kernel measured against the torch path: docs/worker.md, "Attention on CPUs".

Each kernel is compiled on first use with torch's cpp_extension (about 10 s; cached under TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions, and rebuilt when the source changes). `make setup` builds it, so the
first request does not wait. If the compiler or the CPU is missing, the torch path runs and a warning says why.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvkernels.attention import FP8_DTYPE, AttentionMetadata
from kvkernels.torch_attention import TorchAttentionBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]
FP32_SOURCE = Path(__file__).with_name("cpu_attention_fp32.cpp")
# The AVX2 + FMA kernels' instructions and build: the float32 attention kernel here, the bf16 linear kernel
# (cpu_linear.py) and the fused float32 ops (cpu_fused_ops.py).
AVX2_REQUIRED_FLAGS = ("avx2", "fma")
AVX2_COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
HEAD_DIMS = (32, 64, 128)
BUILD_NOTICE_S = 2.0  # a load that takes longer is compiling, and says so (load_extension)
# torch's build lock (wait_for_build_lock): one nobody holds for this long was left by a killed build; one held
# past BUILD_LOCK_WAIT_S (longer than any compile of ours, a few minutes at most) fails the load naming the file.
STALE_LOCK_GRACE_S = 2.0
BUILD_LOCK_WAIT_S = 600.0
LOCK_POLL_S = 0.2
# Comma-separated flags to treat as absent: runs (and measures) on this machine the branch a CPU without them
# takes, e.g. KVROUTE_CPU_HIDE_FLAGS=avx512_bf16,amx_bf16 for an AVX2-only CPU's dtype and attention path.
HIDE_FLAGS_ENV = "KVROUTE_CPU_HIDE_FLAGS"
# The flags by which a CPU multiplies bfloat16 natively, per architecture: AVX-512 BF16 dot products or AMX tiles
# on x86, FEAT_BF16 (BFDOT / BFMMLA) on ARM. Without one, torch emulates bf16 matmuls, several times slower than
# float32.
NATIVE_BF16_FLAGS = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}
# The x86 CPU classes whose branches the engine's choices differ by, richest last, each as the environment under
# which a richer CPU takes that class's branches: our flags hidden, and torch's, oneDNN's and MKL's own dispatch
# capped to match. One AMX machine runs all three (tests/test_cpu_classes.py).
_AMX_FLAGS = "amx_bf16,amx_tile,amx_int8,amx_fp16"
CPU_CLASSES: dict[str, dict[str, str]] = {
    "avx2": {
        HIDE_FLAGS_ENV: f"avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512_bf16,avx512_vnni,{_AMX_FLAGS}",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    "avx512_bf16": {HIDE_FLAGS_ENV: _AMX_FLAGS, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}


@functools.cache
def _proc_cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _proc_cpu_flags() -> frozenset[str]:
    info = _proc_cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())  # x86 | ARM


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (`flags` on x86, `Features` on ARM; empty where there is none),
    less those named in $KVROUTE_CPU_HIDE_FLAGS. Every CPU feature check of the engine reads this."""
    hidden = {flag.strip() for flag in os.environ.get(HIDE_FLAGS_ENV, "").split(",")}
    return set(_proc_cpu_flags()) - hidden


def cpu_description() -> str:
    """The CPU's model and the flags the engine's choices read, with what is hidden or capped, for benchmark
    reports (e.g. "Intel(R) Xeon(R) Processor; avx2 avx512f avx512_bf16 amx_bf16")."""
    info = _proc_cpuinfo()
    model = info.get("model name") or info.get("CPU part") or platform.processor() or platform.machine()
    relevant = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "bf16")
    parts = [model, " ".join(flag for flag in relevant if flag in cpu_flags())]
    for env in (HIDE_FLAGS_ENV, "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        if os.environ.get(env):
            parts.append(f"{env}={os.environ[env]}")
    return "; ".join(parts)


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU multiplies bfloat16 natively, and the flags that say so, or the ones it lacks
    (e.g. `(False, "no avx512_bf16/amx_bf16")`)."""
    machine = {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
    wanted = NATIVE_BF16_FLAGS.get(machine)
    if wanted is None:
        return False, f"no bf16 instructions known for {machine}"
    found = [flag for flag in wanted if flag in cpu_flags()]
    return (True, "/".join(found)) if found else (False, "no " + "/".join(wanted))


def cpu_class() -> str | None:
    """This machine's class in CPU_CLASSES (after the hide switch), or None for a CPU below all of them (no AVX2 and
    FMA, or not x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_flags()
    if "amx_bf16" in flags and all(flag in flags for flag in REQUIRED_FLAGS):
        return "amx"
    if all(flag in flags for flag in REQUIRED_FLAGS):
        return "avx512_bf16"
    if all(flag in flags for flag in AVX2_REQUIRED_FLAGS):
        return "avx2"
    return None


def missing_x86_flags(required: tuple[str, ...]) -> str | None:
    """Why this machine cannot run an x86 kernel that needs `required` (cpu_flags), or None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU is {platform.machine()}, not x86_64"
    missing = [flag for flag in required if flag not in cpu_flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def load_extension(what: str, name: str, source: Path, cflags: list[str], required: tuple[str, ...]) -> bool:
    """Compile (or load the cached build of) a C++ op library with torch's cpp_extension, which registers its ops;
    False, with a warning naming `what` and why (the flags of `required` this CPU lacks, the first compiler error
    line, or a build lock held past BUILD_LOCK_WAIT_S), when it cannot run here."""
    reason = missing_x86_flags(required)
    if reason is None:
        try:
            from torch.utils.cpp_extension import load

            build_directory = _build_directory(name)
            build_directory.mkdir(parents=True, exist_ok=True)
            # A cached build loads in ~0.1 s; a compile takes 10 s to a few minutes, a first start's wait.
            notice = threading.Timer(BUILD_NOTICE_S, _say_compiling, (what, build_directory))
            notice.daemon = True
            notice.start()
            try:
                wait_for_build_lock(build_directory / "lock")
                load(
                    name=name,
                    sources=[str(source)],
                    extra_cflags=cflags,
                    build_directory=str(build_directory),
                    is_python_module=False,
                    verbose=False,
                )
            finally:
                notice.cancel()
            return True
        except BuildLockHeld as exc:
            reason = str(exc)
        except (RuntimeError, OSError, ImportError) as exc:
            errors = [line for line in str(exc).splitlines() if "error" in line] or [str(exc)]
            reason = f"it did not build: {errors[0].strip()}"
    log.warning("%s unavailable, torch runs instead: %s", what, reason)
    return False


def _build_directory(name: str) -> Path:
    """Where torch builds and caches `name`: $TORCH_EXTENSIONS_DIR/name, else torch's default root with its
    Python tag (torch's own layout for a CPU build). Named here, not left to torch, so that the lock
    wait_for_build_lock watches is the one torch takes."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / name


class BuildLockHeld(RuntimeError):
    """A build lock stayed held by a live process past BUILD_LOCK_WAIT_S."""


def wait_for_build_lock(lock: Path) -> None:
    """Return once `lock` (torch's build lock for one extension) is gone, instead of torch's unbounded wait.

    torch's FileBaton creates the file and keeps it open for the whole build, then closes and removes it. A build
    that was killed leaves the file behind, and every later load would wait on it forever. So: a lock that no
    process has had open for STALE_LOCK_GRACE_S (the gap between torch's close and remove is microseconds) is
    stale, removed with a line on stderr, and the build runs again; a lock still held after BUILD_LOCK_WAIT_S
    (a build hung elsewhere, or one whose holder this process cannot see, e.g. another container sharing the
    cache) raises BuildLockHeld naming the file to delete. Holders are read from /proc (Linux); where it cannot
    tell (no /proc, or a lock another user created, whose processes this one may not read), a lock counts as
    held."""
    started = time.monotonic()
    unheld_since: float | None = None
    while lock.exists():
        now = time.monotonic()
        holders = _lock_holders(lock)
        if holders == []:
            unheld_since = unheld_since if unheld_since is not None else now
            if now - unheld_since >= STALE_LOCK_GRACE_S:
                print(
                    f"kvroute: removing the stale build lock {lock} (no process holds it: a build was killed); "
                    "building again",
                    file=sys.stderr,
                    flush=True,
                )
                lock.unlink(missing_ok=True)
                return
        else:
            unheld_since = None
        if now - started >= BUILD_LOCK_WAIT_S:
            by = f"process {', '.join(map(str, holders))}" if holders else "a process this one cannot see"
            message = (
                f"the build lock {lock} has been held by {by} for {BUILD_LOCK_WAIT_S:.0f} s; "
                f"if no build is running, delete {lock}"
            )
            print(f"kvroute: {message}", file=sys.stderr, flush=True)
            raise BuildLockHeld(message)
        time.sleep(LOCK_POLL_S)


def _lock_holders(lock: Path) -> list[int] | None:
    """The ids of the processes that have `lock` open, or None where this process cannot tell: no /proc (not
    Linux), or a lock of another user's (only root reads every process's open files)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    try:
        owner = lock.stat().st_uid
    except FileNotFoundError:
        return []
    if os.getuid() not in (0, owner):
        return None
    target = str(lock.resolve())
    holders = []
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(pid_dir.name))
                    break
            except OSError:
                continue
    return holders


def _say_compiling(what: str, build_directory: Path) -> None:
    print(
        f"kvroute: compiling the {what} (first use; cached under {build_directory} for the next start)",
        file=sys.stderr,
        flush=True,
    )


def unsupported_reason() -> str | None:
    """Why this machine cannot run the bf16 kernel, or None when it can."""
    return missing_x86_flags(REQUIRED_FLAGS)


def fp32_unsupported_reason() -> str | None:
    """Why this machine cannot run the AVX2 float32 kernel, or None when it can."""
    return missing_x86_flags(AVX2_REQUIRED_FLAGS)


def fp32_kernel_skipped_reason() -> str | None:
    """Why float32 models do not take the float32 kernel here, or None when they do. Only x86 CPUs with AVX2 and
    FMA and without AVX-512 take it (with AVX-512, SDPA's own code is faster on long prefills and extends:
    docs/worker.md, "Attention on CPUs")."""
    if (reason := fp32_unsupported_reason()) is not None:
        return reason
    return "SDPA's AVX-512 code is faster than the AVX2 kernel" if "avx512f" in cpu_flags() else None


@functools.cache
def load_kernel() -> bool:
    """Compile (or load the cached build of) the bf16 kernel and register torch.ops.kvroute_cpu; False, with a
    warning, when it cannot run here."""
    return load_extension("CPU bf16 attention kernel", "kvroute_cpu_attention", SOURCE, COMPILE_FLAGS, REQUIRED_FLAGS)


@functools.cache
def load_fp32_kernel() -> bool:
    """The same for the float32 kernel (torch.ops.kvroute_cpu_fp32)."""
    return load_extension(
        "CPU float32 attention kernel",
        "kvroute_cpu_attention_fp32",
        FP32_SOURCE,
        AVX2_COMPILE_FLAGS,
        AVX2_REQUIRED_FLAGS,
    )


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.luts: dict[tuple[float, torch.dtype], torch.Tensor] = {}
        # Read once: the hide switch holds for this backend's life.
        self.unsupported = unsupported_reason()
        self.fp32_skipped = fp32_kernel_skipped_reason()

    def describe(self, dtype: torch.dtype, head_dim: int) -> str:
        """Which path `attend` takes for a model of this dtype and head size, and why, in one line for the
        startup log and GetInfo. Builds the kernel when the model will use it, as warm-up would."""
        if dtype not in (torch.bfloat16, torch.float32):
            return f"cpu: torch path (a {str(dtype).removeprefix('torch.')} model; the C++ kernels run bf16/float32)"
        if head_dim not in HEAD_DIMS:
            return f"cpu: torch path (head_dim {head_dim}; the C++ kernels run {'/'.join(map(str, HEAD_DIMS))})"
        if dtype == torch.float32:
            if self.fp32_skipped is not None:
                return f"cpu: torch path (a float32 model; {self.fp32_skipped})"
            if not load_fp32_kernel():
                return "cpu: torch path (the C++ float32 kernel did not build; see the warning)"
            return "cpu: C++ AVX2 float32 paged attention kernel"
        if self.unsupported is not None:
            return f"cpu: torch path ({self.unsupported})"
        if not load_kernel():
            return "cpu: torch path (the C++ kernel did not build; see the warning)"
        return "cpu: C++ AVX-512 BF16 paged attention kernel"

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if self.runs_kernel(q, k_cache):
            op = torch.ops.kvroute_cpu.paged_attention
        elif self.runs_fp32_kernel(q, k_cache):
            op = torch.ops.kvroute_cpu_fp32.paged_attention
        else:
            return super().attend(q, k_cache, v_cache, meta, softmax_scale, k_scale, v_scale)
        return self.call_kernel(op, q, k_cache, v_cache, meta, softmax_scale, k_scale, v_scale)

    def call_kernel(
        self,
        op: Callable[..., None],
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        softmax_scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """One of the kernels' `paged_attention` ops on this step, whether or not `attend` would choose it (the
        benchmark and the tests call it directly)."""
        out = torch.empty_like(q)
        fp8 = k_cache.dtype == FP8_DTYPE
        op(
            q.contiguous(),
            k_cache.view(torch.uint8) if fp8 else k_cache,
            v_cache.view(torch.uint8) if fp8 else v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            softmax_scale,
            self.fp8_lut(k_scale, q.dtype) if fp8 else None,
            self.fp8_lut(v_scale, q.dtype) if fp8 else None,
            out,
        )
        return out

    def runs_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """The kernel's case: bfloat16 on the CPU, a supported head size, and a kernel that loads (compiled on the
        first call that needs it, so float32 models never wait for the compiler)."""
        return (
            q.device.type == "cpu"
            and q.dtype == torch.bfloat16
            and k_cache.dtype in (torch.bfloat16, FP8_DTYPE)
            and q.shape[-1] in HEAD_DIMS
            and self.unsupported is None
            and load_kernel()
        )

    def runs_fp32_kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """The float32 kernel's case: float32 on an x86 CPU with AVX2 and FMA but no AVX-512, a supported head size,
        and a kernel that loads (compiled on the first call that needs it)."""
        return (
            q.device.type == "cpu"
            and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, FP8_DTYPE)
            and q.shape[-1] in HEAD_DIMS
            and self.fp32_skipped is None
            and load_fp32_kernel()
        )

    def fp8_lut(self, scale: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """[256] in `dtype` (the model's): the dequantised value of each FP8 byte under `scale` (the kernels read
        FP8 through it)."""
        if (scale, dtype) not in self.luts:
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
            self.luts[scale, dtype] = (codes.float() * scale).to(dtype)
        return self.luts[scale, dtype]
