"""What the comparison asks of an engine: greedy answers to a batch of prompts under a given submission order
(all requests added, then stepped: continuous batching, as a worker serves them), and next-token logits along a
given token path, compared between two engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvroute.sampling import SamplingParams
from quality.measures import NextTokenDistance, next_token_distance
from worker.engine import LLMEngine
from worker.model.quantized_linear import decode_arithmetic_for_every_step

# prompt_logits' requests carry this salt, so no prefix another request cached shortens the rows they compute.
TEACHER_FORCED_SALT = "kvroute-quality-teacher-forced"


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (only on a terminal), or one that shows nothing."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5, disable=None if enabled else True)


def greedy_answers(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    max_tokens: int,
    order: Sequence[int],
    min_tokens: int = 0,
    desc: str = "greedy",
    progress: bool = False,
) -> list[list[int]]:
    """Each prompt's greedy answer (temperature 0), its requests added in `order` (a permutation of the
    prompts' indexes) before the first step; the answers in prompt order."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.0)
    answers: dict[str, list[int]] = {}
    for index in order:
        engine.validate_request(prompts[index], params)
    for index in order:
        request_id = f"quality-{desc}-{index}"
        engine.add_request(request_id, prompts[index], params)
        answers[request_id] = []
    with progress_bar(len(prompts), desc, progress) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                answers[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    bar.update(1)
    return [answers[f"quality-{desc}-{i}"] for i in range(len(prompts))]


def path_distance(reference: LLMEngine, candidate: LLMEngine, prompt: list[int], path: list[int]) -> NextTokenDistance:
    """The two engines' next-token distributions at each of `path`'s positions after `prompt` (teacher-forced:
    both read the same tokens), one step each."""
    return sequence_distance(reference, candidate, prompt + path[:-1], first_row=len(prompt) - 1)


def sequence_distance(
    reference: LLMEngine, candidate: LLMEngine, sequence: list[int], first_row: int = 0
) -> NextTokenDistance:
    """The two engines' next-token distributions after each of `sequence`'s tokens from `first_row` on, each
    computed with its decode steps' arithmetic (a weight-only model's kernel, not the dequantized prefill path)."""
    ref = decode_arithmetic_logits(reference, sequence)[first_row:]
    cand = decode_arithmetic_logits(candidate, sequence)[first_row:]
    return next_token_distance(ref, cand)


def decode_arithmetic_logits(engine: LLMEngine, sequence: list[int]) -> Any:
    model = getattr(engine.runner, "model", None)
    if model is None:
        return engine.prompt_logits(sequence, cache_salt=TEACHER_FORCED_SALT)
    with decode_arithmetic_for_every_step(model):
        return engine.prompt_logits(sequence, cache_salt=TEACHER_FORCED_SALT)


def paths_distance(
    reference: LLMEngine,
    candidate: LLMEngine,
    prompts: Sequence[list[int]],
    paths: Sequence[list[int]],
    desc: str = "distance",
    progress: bool = False,
) -> list[NextTokenDistance]:
    with progress_bar(len(prompts), desc, progress) as bar:
        distances = []
        for prompt, path in zip(prompts, paths, strict=True):
            distances.append(path_distance(reference, candidate, prompt, path))
            bar.update(1)
    return distances


def logit_agreement(reference: LLMEngine, candidate: LLMEngine, sequences: Sequence[list[int]]) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || candidate) over every position of `sequences`, each read whole by
    both engines (engine_bench's `bf16_quality` figures: positions, top1_agreement, mean_kl)."""
    agree, kl, positions = 0.0, 0.0, 0
    for sequence in sequences:
        distance = sequence_distance(reference, candidate, sequence)
        agree += distance.top1.sum().item()
        kl += distance.kl.sum().item()
        positions += len(sequence)
    return {"positions": positions, "top1_agreement": agree / positions, "mean_kl": kl / positions}
