"""Long-output drift (seed 004: "test it on long outputs; the failure mode is drift"): on a few prompts, both sides
generate long greedy answers (EOS held off, so every answer has the full length), and the measure follows output
position: teacher-forced top-1 agreement and KL along the reference's answer, and the share of free-running
candidate answers still identical to the reference's. A configuration that is coherent early and degrades late
(an FP8 KV cache whose rounding accumulates over the context) shows as curves that fall with position."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from quality.engine_runs import greedy_answers, paths_distance
from quality.measures import by_position, first_divergence
from worker.engine import LLMEngine


@dataclass
class LongOutputs:
    num_prompts: int
    tokens: int  # each answer's length
    top1_by_position: list[float]  # teacher-forced, the mean over prompts at each output position
    kl_by_position: list[float]
    identical_by_position: list[float]  # share of free-running answers equal to the reference's through position t
    first_divergence: list[int | None]  # per prompt; None: identical throughout
    reference_answers: list[list[int]]
    candidate_answers: list[list[int]]

    def metrics(self) -> dict[str, float]:
        late = self.top1_by_position[len(self.top1_by_position) * 3 // 4 :]
        return {
            "long_top1": statistics.fmean(self.top1_by_position),
            "long_top1_late": statistics.fmean(late),
            "long_mean_kl": statistics.fmean(self.kl_by_position),
            "long_identical": sum(d is None for d in self.first_divergence) / len(self.first_divergence),
        }


def measure_long_outputs(
    reference: LLMEngine,
    candidate: LLMEngine,
    prompts: Sequence[list[int]],
    tokens: int,
    progress: bool = False,
) -> LongOutputs:
    """`prompts` answered `tokens` long by both engines (batched, in order), then compared position by position."""
    order = range(len(prompts))
    ref = greedy_answers(reference, prompts, tokens, order, tokens, "long reference", progress)
    cand = greedy_answers(candidate, prompts, tokens, order, tokens, "long candidate", progress)
    distances = paths_distance(reference, candidate, prompts, ref, "long distance", progress)
    divergences = [first_divergence(r, c) for r, c in zip(ref, cand, strict=True)]
    identical = [sum(d is None or d > position for d in divergences) / len(divergences) for position in range(tokens)]
    return LongOutputs(
        num_prompts=len(prompts),
        tokens=tokens,
        top1_by_position=by_position([d.top1 for d in distances]),
        kl_by_position=by_position([d.kl for d in distances]),
        identical_by_position=identical,
        first_divergence=divergences,
        reference_answers=ref,
        candidate_answers=cand,
    )
