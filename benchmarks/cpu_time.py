"""CPU time of this process, the measure of benchmarks that share a machine with other jobs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_cpu_us(fn: Callable[[], object], repeats: int) -> float:
    """The median CPU time of one call of `fn` in µs, over `repeats` calls: this process's threads (the
    tokenizer's too), so other jobs on a shared machine do not count. Measure before the process starts
    threads of its own that would count too."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e6
