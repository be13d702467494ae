"""The comparison, in the order the seeds ask for it (Q9, Q10, 004):

1. Checks first: every prompt rendered under the reference's and the candidate's chat templates; any difference
   refuses the comparison (TemplateMismatch), since it would measure the templates, not the numerics.
2. Reference run A: greedy answers to every prompt, all added at once (continuous batching, `max_num_seqs` of
   the reference's config), in prompt order.
3. The noise floor: the reference again, on a second engine batching differently (half its `max_num_seqs`, the
   prompts submitted in reverse order). Temperature 0 is not determinism: a different batch shape sums the
   same products in another order, and near-tied tokens flip. Answers differing from run A are the floor.
4. The candidate: greedy answers under run A's order; answers differing from run A are its flips, paired per
   prompt with the floor's.
5. Distance, labels-free: both sides' next-token distributions along run A's answers (teacher-forced), top-1
   agreement and KL(reference || candidate) per position.
6. Long outputs: a few prompts answered long by both (quality/drift.py).

Engines come from each side's factory (`Side.build`, LLMEngine by default), so a test can hand in an engine it
altered. Engines of one model in one process share its weights (worker.engine._load_model), so a factory that
alters weights must give its engine weights of its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from quality.drift import LongOutputs, measure_long_outputs
from quality.engine_runs import greedy_answers, paths_distance
from quality.measures import Rate, by_position, flip_rate, paired_difference
from quality.prompts import Prompt, PromptSet
from quality.template_check import check_same_prompts, with_template
from worker.config import EngineConfig
from worker.engine import LLMEngine

EngineFactory = Callable[[EngineConfig], LLMEngine]


@dataclass(frozen=True)
class Side:
    """One configuration: the engine's config, its chat template (None: the model's), a label for the report,
    and how its engines are built."""

    config: EngineConfig
    chat_template: str | None = None
    label: str = ""
    build: EngineFactory = LLMEngine


@dataclass(frozen=True)
class Settings:
    max_tokens: int = 64  # each greedy answer's limit
    long_tokens: int = 512  # each long output's length (0: no long outputs)
    progress: bool = False  # tqdm bars on stderr


@dataclass
class Comparison:
    """Everything one run measured. `metrics()` gives the values a decision rule reads."""

    model: str
    reference: str
    candidate: str
    floor_batching: str  # how the noise floor's run differed from run A
    max_tokens: int
    num_prompts: int
    prompt_tokens: list[int]
    answers_a: list[list[int]]
    answers_floor: list[list[int]]
    answers_candidate: list[list[int]]
    flips: Rate
    noise_floor: Rate
    flips_above_floor: Rate
    positions: int  # next-token distributions compared along run A's answers
    top1: float
    mean_kl: float
    top1_by_position: list[float]
    kl_by_position: list[float]
    long: LongOutputs | None
    seconds: dict[str, float] = field(default_factory=dict)  # by phase

    def metrics(self) -> dict[str, float]:
        values = {
            "top1": self.top1,
            "mean_kl": self.mean_kl,
            "flips": self.flips.value,
            "noise_floor": self.noise_floor.value,
            "flips_above_floor": self.flips_above_floor.value,
            "flips_above_floor_high": self.flips_above_floor.high,
        }
        if self.long is not None:
            values.update(self.long.metrics())
        return values


def render_prompts(
    prompts: Sequence[Prompt], tokenizer: Tokenizer, reference: Side, candidate: Side
) -> list[list[int]]:
    """Every prompt's ids under the reference's template, after checking the candidate's give the same ids
    (TemplateMismatch otherwise)."""
    ref_tokenizer = with_template(tokenizer, reference.chat_template)
    cand_tokenizer = with_template(tokenizer, candidate.chat_template)
    ref_ids = [p.render(ref_tokenizer) for p in prompts]
    cand_ids = ref_ids if cand_tokenizer is ref_tokenizer else [p.render(cand_tokenizer) for p in prompts]
    check_same_prompts(ref_ids, cand_ids, tokenizer)
    return ref_ids


def compare(reference: Side, candidate: Side, prompt_set: PromptSet, settings: Settings) -> Comparison:
    """Run the protocol (the module's docstring). Both sides must name one model."""
    if reference.config.model != candidate.config.model:
        raise ValueError(f"one model on both sides, got {reference.config.model!r} and {candidate.config.model!r}")
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase] = round(now - clock, 2)
        clock = now

    tokenizer = Tokenizer.for_model(resolve_model(reference.config.model))
    prompts = render_prompts(prompt_set.prompts, tokenizer, reference, candidate)
    long_prompts = render_prompts(prompt_set.long_form, tokenizer, reference, candidate)
    lap("template check")
    in_order = list(range(len(prompts)))
    ref_engine = reference.build(reference.config)
    answers_a = greedy_answers(ref_engine, prompts, settings.max_tokens, in_order, 0, "reference A", settings.progress)
    lap("reference A")
    floor_seqs = max(1, reference.config.max_num_seqs // 2)
    floor_engine = reference.build(dataclasses.replace(reference.config, max_num_seqs=floor_seqs))
    answers_floor = greedy_answers(
        floor_engine, prompts, settings.max_tokens, in_order[::-1], 0, "noise floor", settings.progress
    )
    del floor_engine  # its KV cache
    lap("noise floor")
    cand_engine = candidate.build(candidate.config)
    answers_cand = greedy_answers(
        cand_engine, prompts, settings.max_tokens, in_order, 0, "candidate", settings.progress
    )
    lap("candidate")
    distances = paths_distance(ref_engine, cand_engine, prompts, answers_a, "distance", settings.progress)
    lap("distance")
    long = None
    if settings.long_tokens and long_prompts:
        long = measure_long_outputs(ref_engine, cand_engine, long_prompts, settings.long_tokens, settings.progress)
        lap("long outputs")
    cand_flips = _flips(answers_a, answers_cand)
    floor_flips = _flips(answers_a, answers_floor)
    positions = sum(len(d.top1) for d in distances)
    return Comparison(
        model=reference.config.model,
        reference=reference.label,
        candidate=candidate.label,
        floor_batching=(
            f"max_num_seqs {reference.config.max_num_seqs} -> {floor_seqs}, prompts submitted in reverse order"
        ),
        max_tokens=settings.max_tokens,
        num_prompts=len(prompts),
        prompt_tokens=[len(p) for p in prompts],
        answers_a=answers_a,
        answers_floor=answers_floor,
        answers_candidate=answers_cand,
        flips=flip_rate(cand_flips),
        noise_floor=flip_rate(floor_flips),
        flips_above_floor=paired_difference(cand_flips, floor_flips),
        positions=positions,
        top1=sum(d.top1.sum().item() for d in distances) / positions,
        mean_kl=sum(d.kl.sum().item() for d in distances) / positions,
        top1_by_position=by_position([d.top1 for d in distances]),
        kl_by_position=by_position([d.kl for d in distances]),
        long=long,
        seconds=seconds,
    )


def _flips(reference: Sequence[list[int]], other: Sequence[list[int]]) -> list[bool]:
    return [a != b for a, b in zip(reference, other, strict=True)]
