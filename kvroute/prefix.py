"""Where two sequences stop sharing their prefix: token ids, or chained block hashes (the blocks they share)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading items `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
