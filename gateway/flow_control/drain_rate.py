"""How fast the gateway's queue drains, measured: what a refused request's `Retry-After` is computed from."""

from __future__ import annotations

import math
from collections import deque

WINDOW = 64  # the last dispatches from the queue the rate is measured over
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class DrainRate:
    """Dispatches per second over the last WINDOW dispatches out of the queue (`dispatched(now)`)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=WINDOW)

    def dispatched(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float | None:
        """The measured rate; None before two dispatches. A queue that stopped draining decays to 0: the time
        since the last dispatch counts as one more interval."""
        if len(self._times) < 2:
            return None
        span = max(now, self._times[-1]) - self._times[0]
        return (len(self._times) - 1) / span if span > 0 else None

    def retry_after(self, queued_ahead: int, now: float) -> int:
        """Whole seconds until `queued_ahead` requests have left at the measured rate, in [1, 60]; 1 with no
        rate measured yet (the queue has not been drained: it may have room at once)."""
        rate = self.per_second(now)
        if not rate:
            return MIN_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil((queued_ahead + 1) / rate)))
