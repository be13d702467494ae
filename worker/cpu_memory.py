"""Keep freed activation memory in the process instead of handing it back to the OS after every layer.

Each layer allocates and frees activations of a few hundred KB to tens of MB. glibc serves blocks over its
mmap threshold (128 KB at start) with fresh mmaps and returns them on free, so every layer pays page faults
on memory it just released: a float32 RMSNorm over 400 x 576 takes 540 us that way and 70 us from a warm heap;
SmolLM2's prefill runs about 15% faster (3,000 tokens, bf16, 2 threads) with the heap kept. This is what
vLLM's CPU guide gets from preloading tcmalloc, done in-process with mallopt, so it needs nothing installed.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value: blocks up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap kept for reuse before it is returned


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where the C library is not glibc (nothing changes)."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
