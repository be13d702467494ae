"""What a comparison prints and saves: a plain-text report a person reads in one screen, and a JSON document with
everything measured (the answers' token ids included, so a flip can be looked at)."""

from __future__ import annotations

import statistics
from typing import Any

from quality.decision_rule import METRICS, DecisionRule, Verdict
from quality.measures import Rate
from quality.protocol import Comparison

LONG_BANDS = 4  # the long outputs' positions shown in this many bands


def text_report(comparison: Comparison, rule: DecisionRule, verdict: Verdict, prompts_source: str) -> str:
    c = comparison
    lines = [
        f"kvroute quality: model {c.model}, reference {c.reference!r} against candidate {c.candidate!r}",
        f"{c.num_prompts} prompts ({prompts_source}), greedy answers of up to {c.max_tokens} tokens",
        f"noise floor: the reference again, {c.floor_batching}",
        "",
        f"distance along reference A's answers ({c.positions:,} positions, teacher-forced)",
        f"  top-1 agreement  {c.top1:.4f}",
        f"  mean KL          {c.mean_kl:.5f} nats (reference || candidate)",
        "flips: answers differing from reference run A, with 95% intervals",
        f"  noise floor      {_rate(c.noise_floor)}",
        f"  candidate        {_rate(c.flips)}",
        f"  above the floor  {c.flips_above_floor.value:+.3f} ± {c.flips_above_floor.half_width:.3f} (paired)",
    ]
    if c.long is not None:
        long = c.long
        bands = _bands(long.tokens)
        lines += [
            f"long outputs: {long.num_prompts} prompts x {long.tokens} tokens, by output position",
            "  positions       " + "".join(f"{f'{a}-{b - 1}':>11}" for a, b in bands),
            "  top-1           " + "".join(f"{_mean(long.top1_by_position, a, b):>11.4f}" for a, b in bands),
            "  mean KL         " + "".join(f"{_mean(long.kl_by_position, a, b):>11.5f}" for a, b in bands),
            "  still identical " + "".join(f"{long.identical_by_position[b - 1]:>11.3f}" for a, b in bands),
            f"  first divergence of free-running greedy: {_divergences(long.first_divergence, long.tokens)}",
        ]
    lines += ["", f"decision rule: {rule}"]
    for result in verdict.results:
        mark = "holds" if result.holds else "FAILS"
        lines.append(f"  {str(result.clause):<32} measured {result.value:.4f}  {mark}")
    lines.append(f"verdict: {'PASS' if verdict.passed else 'FAIL'}")
    total = sum(c.seconds.values())
    lines.append(f"time: {total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in c.seconds.items()) + ")")
    return "\n".join(lines)


def json_report(comparison: Comparison, rule: DecisionRule, verdict: Verdict, prompts_source: str) -> dict[str, Any]:
    c = comparison
    document: dict[str, Any] = {
        "model": c.model,
        "reference": c.reference,
        "candidate": c.candidate,
        "prompts": prompts_source,
        "num_prompts": c.num_prompts,
        "floor_batching": c.floor_batching,
        "metrics": c.metrics(),
        "metric_descriptions": {name: METRICS[name] for name in c.metrics()},
        "rule": str(rule),
        "verdict": {
            "passed": verdict.passed,
            "clauses": [
                {"clause": str(r.clause), "metric": r.clause.metric, "value": r.value, "holds": r.holds}
                for r in verdict.results
            ],
        },
        "flips": _rate_json(c.flips),
        "noise_floor": _rate_json(c.noise_floor),
        "flips_above_floor": _rate_json(c.flips_above_floor),
        "flipped_prompts": {
            "candidate": [i for i, (a, b) in enumerate(zip(c.answers_a, c.answers_candidate, strict=True)) if a != b],
            "noise_floor": [i for i, (a, b) in enumerate(zip(c.answers_a, c.answers_floor, strict=True)) if a != b],
        },
        "distance": {
            "positions": c.positions,
            "top1": c.top1,
            "mean_kl": c.mean_kl,
            "top1_by_position": c.top1_by_position,
            "kl_by_position": c.kl_by_position,
        },
        "long_outputs": None,
        "prompt_tokens": c.prompt_tokens,
        "answers": {"reference_a": c.answers_a, "noise_floor": c.answers_floor, "candidate": c.answers_candidate},
        "seconds": c.seconds,
    }
    if c.long is not None:
        document["long_outputs"] = {
            "num_prompts": c.long.num_prompts,
            "tokens": c.long.tokens,
            "top1_by_position": c.long.top1_by_position,
            "kl_by_position": c.long.kl_by_position,
            "identical_by_position": c.long.identical_by_position,
            "first_divergence": c.long.first_divergence,
            "answers": {"reference": c.long.reference_answers, "candidate": c.long.candidate_answers},
        }
    return document


def _divergences(first: list[int | None], tokens: int) -> str:
    diverged = sorted(d for d in first if d is not None)
    if not diverged:
        return f"none diverged (all {len(first)} identical throughout)"
    median = statistics.median([*diverged, *([tokens] * (len(first) - len(diverged)))])
    return (
        f"median position {median:g} (first {diverged[0]}, last {diverged[-1]}), {len(first) - len(diverged)} of "
        f"{len(first)} identical throughout"
    )


def _rate(rate: Rate) -> str:
    return f"{rate.value:.3f} ± {rate.half_width:.3f} ({round(rate.value * rate.n)}/{rate.n})"


def _rate_json(rate: Rate) -> dict[str, float]:
    return {"value": rate.value, "low": rate.low, "high": rate.high, "n": rate.n}


def _bands(tokens: int) -> list[tuple[int, int]]:
    edges = [round(tokens * i / LONG_BANDS) for i in range(LONG_BANDS + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def _mean(values: list[float], start: int, stop: int) -> float:
    return statistics.fmean(values[start:stop])
