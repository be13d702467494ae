"""The decision rule, written before the run: clauses `METRIC OP NUMBER` joined by commas (or one a line in a
file, `#` comments allowed), every one of which must hold for the candidate to pass. Parsed strictly: a metric
outside METRICS, an operator other than <= >= < >, or anything but a plain number is a UserError."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvroute.errors import UserError

METRICS = {
    "top1": "top-1 agreement of next-token distributions along the reference's greedy answers",
    "mean_kl": "mean KL(reference || candidate) in nats along the reference's greedy answers",
    "flips": "share of prompts whose greedy answer differs from reference run A",
    "noise_floor": "share of prompts whose answer differs between the two reference runs (other batching)",
    "flips_above_floor": "flips less noise_floor, paired per prompt",
    "flips_above_floor_high": "the upper end of flips_above_floor's 95% interval",
    "long_top1": "top-1 agreement over the long outputs' positions (teacher-forced)",
    "long_top1_late": "top-1 agreement over the long outputs' last quarter of positions",
    "long_mean_kl": "mean KL over the long outputs' positions",
    "long_identical": "share of long free-running outputs identical to the reference's throughout",
}
LONG_METRICS = frozenset(name for name in METRICS if name.startswith("long_"))
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_CLAUSE = re.compile(r"\s*([A-Za-z0-9_]+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")


class Clause(NamedTuple):
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


class ClauseResult(NamedTuple):
    clause: Clause
    value: float
    holds: bool


class Verdict(NamedTuple):
    passed: bool
    results: list[ClauseResult]


class DecisionRule(NamedTuple):
    clauses: list[Clause]

    @property
    def metrics(self) -> set[str]:
        return {clause.metric for clause in self.clauses}

    def judge(self, values: Mapping[str, float]) -> Verdict:
        """Every clause against the measured `values` (KeyError for a metric not measured); a NaN value fails."""
        results = []
        for clause in self.clauses:
            value = values[clause.metric]
            holds = not math.isnan(value) and OPERATORS[clause.op](value, clause.threshold)
            results.append(ClauseResult(clause, value, holds))
        return Verdict(all(r.holds for r in results), results)

    def __str__(self) -> str:
        return ",".join(map(str, self.clauses))


def parse_rule(text: str, where: str = "--accept") -> DecisionRule:
    """Clauses separated by commas or newlines; `#` starts a comment running to the line's end."""
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    pieces = [piece.strip() for line in lines if line.strip() for piece in line.split(",")]
    clauses = []
    for piece in pieces:
        match = _CLAUSE.fullmatch(piece)
        if match is None:
            raise UserError(f"{where}: {piece!r} is not METRIC OP NUMBER (OP one of <= >= < >)")
        metric, op, number = match.groups()
        if metric not in METRICS:
            raise UserError(f"{where}: unknown metric {metric!r}; known: {', '.join(METRICS)}")
        clauses.append(Clause(metric, op, float(number)))
    if not clauses:
        raise UserError(f"{where}: a decision rule needs at least one clause, e.g. flips_above_floor<=0.02")
    return DecisionRule(clauses)
