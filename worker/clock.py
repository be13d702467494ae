"""The engine's clock: wall time for a live worker, virtual time for the fleet simulator (sim/).

`now()` is seconds on a monotonic scale; `sleep(seconds)` spends time. The engine stamps request timings with
`now()`; the sim runner spends a step's cost with `sleep`, so one cost model (worker.sim_runner.SimCostModel)
paces a live sim worker in real time and a simulated replica in virtual time.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Real time: `time.monotonic` and `time.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class VirtualClock:
    """Time that moves only when told: `sleep` advances it at once, `advance_to` jumps forward (never back)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def advance_to(self, t: float) -> None:
        if t > self.t:
            self.t = t


WALL_CLOCK = WallClock()
