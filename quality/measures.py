"""The arithmetic of the comparison, free of engines: how far apart two next-token distributions are (seed Q9:
top-1 agreement and KL, labels-free), how often answers flip, and 95% bounds on both (normal approximation,
±1.96·√(p(1−p)/n); for a paired difference, the same with the variance of the per-prompt differences)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

Z95 = 1.96


class NextTokenDistance(NamedTuple):
    """Per position of a sequence: whether the two most likely next tokens agree, and KL(reference || candidate)
    in nats."""

    top1: torch.Tensor  # bool [n]
    kl: torch.Tensor  # float64 [n]


def next_token_distance(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> NextTokenDistance:
    """reference_logits, candidate_logits: [n, vocab], the same positions of the same sequence."""
    ref = reference_logits.double().log_softmax(-1)
    cand = candidate_logits.double().log_softmax(-1)
    top1 = ref.argmax(-1) == cand.argmax(-1)
    kl = (ref.exp() * (ref - cand)).sum(-1).clamp_min(0.0)  # exact KL is >= 0; rounding can dip below
    return NextTokenDistance(top1, kl)


class Rate(NamedTuple):
    """A share of n prompts (or a difference of two shares) with the half-width of its 95% interval."""

    value: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.value - self.half_width

    @property
    def high(self) -> float:
        return self.value + self.half_width


def flip_rate(flips: Sequence[bool]) -> Rate:
    """The share of prompts whose answer flipped, ±1.96·√(p(1−p)/n)."""
    n = len(flips)
    p = sum(flips) / n
    return Rate(p, Z95 * math.sqrt(p * (1 - p) / n), n)


def paired_difference(candidate_flips: Sequence[bool], floor_flips: Sequence[bool]) -> Rate:
    """The candidate's flip rate less the noise floor's, prompt by prompt: the mean of d_i = c_i − f_i (each -1, 0
    or 1), ±1.96·√(var(d)/n). Pairing removes the prompts both flip on (the fragile ones) from the spread."""
    n = len(candidate_flips)
    if len(floor_flips) != n:
        raise ValueError(f"{n} candidate flips against {len(floor_flips)} floor flips: the pairs must match")
    diffs = [int(c) - int(f) for c, f in zip(candidate_flips, floor_flips, strict=True)]
    mean = sum(diffs) / n
    variance = sum(d * d for d in diffs) / n - mean * mean
    return Rate(mean, Z95 * math.sqrt(max(variance, 0.0) / n), n)


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """The first output position where two token sequences differ (a length difference counts at the shorter's
    end); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def by_position(values: Sequence[torch.Tensor]) -> list[float]:
    """The mean at each position over the sequences long enough to have it (values: one 1-D tensor each)."""
    length = max((len(v) for v in values), default=0)
    sums = torch.zeros(length, dtype=torch.float64)
    counts = torch.zeros(length, dtype=torch.float64)
    for v in values:
        sums[: len(v)] += v.double()
        counts[: len(v)] += 1
    return (sums / counts).tolist()
