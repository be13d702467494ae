"""Turns the step's logits into tokens: one batched call for every sequence that samples this step.

Greedy rows (temperature below SAMPLING_EPS) take the argmax. Other rows divide by their temperature, keep their
top_k tokens and the smallest set whose probability reaches top_p (of the top-k renormalised distribution, as in
vLLM), and draw by inverse CDF: one uniform number per row, from the row's own generator when it has a seed, so
a seeded request gives the same tokens whatever else is in the batch. Rows that truncate look for their nucleus
among their CANDIDATES most likely tokens first (a top-k, several times cheaper than sorting the vocabulary on a
CPU) and sort the whole vocabulary only when it lies beyond them.

Every tensor lives on the logits' device, and every generator too (one per device for rows without a seed); the
results cross to the host only at the end. The logprob of a chosen token, and a row's top_logprobs
alternatives, come from the model's raw distribution (before temperature / top-k / top-p), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvroute.sampling import SamplingParams
from worker.structured_output import GrammarConstraint, mask_logits

CANDIDATES = 1024  # tokens a truncating row looks for its nucleus among before sorting the whole vocabulary
CHUNK = 256  # columns per chunk of the two-level inverse CDF


class TopLogprobs(NamedTuple):
    """The most likely tokens at one position, most likely first, with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # per row; 0.0 where the request did not ask for logprobs
    # per row, None where the request asked for none; empty when no row of the step asked
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)


@dataclass
class SampledTensors:
    """The sampler's results on the logits' device, before they cross to the host."""

    token_ids: torch.Tensor  # int64 [N]
    logprob_rows: list[int]  # rows that asked for logprobs
    logprobs: torch.Tensor  # float32 [len(logprob_rows)]: the chosen tokens' logprobs
    top_ids: torch.Tensor  # int64 [len(logprob_rows), max top_logprobs]
    top_logprobs: torch.Tensor  # float32, the same shape


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for rows without a seed of their own on `device`, seeded with the sampler's seed."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[device]

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppressed: list[tuple[int, ...]] | None = None,
        constraints: list[GrammarConstraint | None] | None = None,
    ) -> SamplerOutput:
        """`generators[i]` is row i's own generator (on the logits' device), or None to use the sampler's;
        `suppressed[i]` the tokens row i must not pick (min_tokens), None for none anywhere; `constraints[i]`
        row i's grammar (worker/structured_output.py), None for none anywhere."""
        # logits: [N, vocab], one row per sampling sequence
        sampled = self.sample(logits, params, generators, suppressed, constraints)
        logprobs = [0.0] * len(params)
        tops: list[TopLogprobs | None] = [None] * len(params) if any(p.top_logprobs for p in params) else []
        if sampled.logprob_rows:
            chosen = sampled.logprobs.tolist()
            top_ids, top_values = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
            for j, row in enumerate(sampled.logprob_rows):
                logprobs[row] = chosen[j]
                if k := params[row].top_logprobs:
                    tops[row] = TopLogprobs(top_ids[j][:k], top_values[j][:k])
        return SamplerOutput(sampled.token_ids.tolist(), logprobs, tops)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppressed: list[tuple[int, ...]] | None = None,
        constraints: list[GrammarConstraint | None] | None = None,
    ) -> SampledTensors:
        """The tensor half of `__call__`: everything on the logits' device, nothing read back. Logprobs come from
        the raw logits, before min_tokens' suppression and the grammar's mask (as vLLM's do)."""
        device = logits.device
        raw = logits.float()
        logits = suppress(raw, suppressed) if suppressed and any(suppressed) else raw
        if constraints and any(c is not None for c in constraints):
            logits = mask_logits(logits, constraints)
        token_ids = torch.empty(len(params), dtype=torch.int64, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            put_rows(token_ids, greedy_rows, take_rows(logits, greedy_rows).argmax(dim=-1))
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            uniform = torch.cat(
                [
                    torch.rand(1, dtype=torch.float64, device=device, generator=generators[i] or self.generator(device))
                    for i in random_rows
                ]
            )
            drawn = draw(take_rows(logits, random_rows), [params[i] for i in random_rows], uniform)
            put_rows(token_ids, random_rows, drawn)
        want = [i for i, p in enumerate(params) if p.logprobs]
        if not want:
            empty = logits.new_empty((0,))
            return SampledTensors(token_ids, [], empty, empty.long(), empty)
        # log_softmax without materialising it: logit - logsumexp, for the chosen and the top tokens only
        rows = take_rows(raw, want)
        lse = rows.logsumexp(dim=-1, keepdim=True)
        chosen = rows.gather(1, take_rows(token_ids, want)[:, None]) - lse
        top_values, top_ids = rows.topk(max(params[i].top_logprobs for i in want), dim=-1)
        return SampledTensors(token_ids, want, chosen.squeeze(1), top_ids, top_values - lse)


def suppress(logits: torch.Tensor, suppressed: list[tuple[int, ...]]) -> torch.Tensor:
    """A copy of `logits` where row i's `suppressed[i]` tokens are -inf, so neither argmax nor a draw picks them."""
    rows = [i for i, ids in enumerate(suppressed) for _ in ids]
    cols = [t for ids in suppressed for t in ids]
    masked = logits.clone()
    masked[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return masked


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without the copy when `rows` is every row in order."""
    if rows == list(range(x.shape[0])):
        return x
    return x[torch.tensor(rows, device=x.device)]


def put_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """x[rows] = values."""
    x.index_copy_(0, torch.tensor(rows, device=x.device), values)


def draw(logits: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """int64 [N]: each row's token under its temperature, top_k and top_p, at the quantile `uniform[row]` of its
    distribution. A row's token depends on its own logits, params and uniform only, never on the other rows."""
    # logits: float32 [N, V]; uniform: float64 [N] in [0, 1)
    device = logits.device
    weights = tempered_weights(logits, torch.tensor([p.temperature for p in params], device=device))
    tokens = torch.empty(len(params), dtype=torch.int64, device=device)
    plain = [i for i, p in enumerate(params) if p.top_k == 0 and p.top_p >= 1.0]
    if plain:
        put_rows(tokens, plain, inverse_cdf(take_rows(weights, plain), take_rows(uniform, plain)))
    truncating = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if not truncating:
        return tokens
    weights = take_rows(weights, truncating)
    uniform = take_rows(uniform, truncating)
    probs_total = weights.sum(dim=-1, keepdim=True)
    top_k = torch.tensor([params[i].top_k for i in truncating], device=device)
    top_p = torch.tensor([params[i].top_p for i in truncating], device=device)
    vocab = weights.shape[-1]
    values, ids = weights.topk(min(CANDIDATES, vocab), dim=-1)
    values = values / probs_total
    # A row's nucleus lies among the candidates when its top_k does, or (without top_k) when they hold top_p.
    unsure = vocab > CANDIDATES and any(
        params[i].top_k > CANDIDATES or (params[i].top_k == 0 and params[i].top_p < 1.0) for i in truncating
    )
    fits = torch.where(top_k > 0, top_k <= CANDIDATES, values.sum(dim=-1) >= top_p) if unsure else None
    if fits is None or bool(fits.all()):
        picks = inverse_cdf(truncate(values, top_k, top_p), uniform)
        put_rows(tokens, truncating, ids.gather(1, picks[:, None]).squeeze(1))
        return tokens
    for part in (fits, ~fits):
        if not bool(part.any()):
            continue
        if part is fits:
            part_values, part_ids = values[part], ids[part]
        else:
            part_values, part_ids = (weights[part] / probs_total[part]).sort(dim=-1, descending=True)
        picks = inverse_cdf(truncate(part_values, top_k[part], top_p[part]), uniform[part])
        rows = [truncating[j] for j in part.nonzero().squeeze(1).tolist()]
        put_rows(tokens, rows, part_ids.gather(1, picks[:, None]).squeeze(1))
    return tokens


def tempered_weights(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """exp((logits - max) / temperature) per row: softmax(logits / temperature) before normalisation, the top
    token's weight 1. Finite for any temperature > 0, however small: the maximum is subtracted before dividing,
    so nothing overflows to inf - inf, and a temperature that float32 rounds to 0 divides as its smallest
    positive value."""
    # logits: float32 [N, V]; temperature: [N]
    temperature = temperature.clamp(min=torch.finfo().tiny).unsqueeze(1)
    return torch.sub(logits, logits.amax(dim=-1, keepdim=True)).div_(temperature).exp_()


def truncate(sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every probability outside a row's top_k (0 = off) and outside its top_p nucleus of the top-k
    distribution (as vLLM: top-k first, then top-p of what is left, renormalised). `sorted_probs` holds a
    normalised distribution's most likely tokens, most likely first (all of them, or at least the top_k and the
    nucleus); top_k and top_p are on its device. Rows are not renormalised."""
    # sorted_probs: [N, K]; top_k: int [N]; top_p: float [N]
    width = sorted_probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    probs = sorted_probs.masked_fill(torch.arange(width, device=sorted_probs.device) >= k.unsqueeze(1), 0.0)
    # Keep a token while the probability before it is below top_p: the first token always stays.
    total = torch.where(top_k > 0, probs.sum(dim=-1), 1.0)
    before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill(before >= (top_p * total).unsqueeze(1), 0.0)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """int64 [N]: per row, the first column where the running sum of `weights` (>= 0, not necessarily
    normalised, some > 0) exceeds `uniform` times the row's total; never a column of weight 0.

    In two levels, because a running sum is sequential and a sum is not: the sums of CHUNK columns locate the
    chunk, then a running sum inside that chunk alone locates the column (V / CHUNK + CHUNK sequential additions
    per row instead of V)."""
    # weights: [N, V]; uniform: float64 [N] in [0, 1)
    n, width = weights.shape
    if width % CHUNK:
        weights = F.pad(weights, (0, CHUNK - width % CHUNK))
    chunks = weights.view(n, -1, CHUNK)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [N, V / CHUNK]
    target = below(uniform.unsqueeze(1) * chunk_cdf[:, -1:], chunk_cdf[:, -1:])
    chunk = torch.searchsorted(chunk_cdf, target, right=True)  # [N, 1]: its sum is > 0
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    inner_cdf = chunks.gather(1, chunk.unsqueeze(2).expand(-1, -1, CHUNK)).squeeze(1).double().cumsum(dim=-1)
    # The chunk's own running sum may end a rounding error away from its sum above: stay inside it.
    inner_target = below((target - before).clamp(min=0.0), inner_cdf[:, -1:])
    column = torch.searchsorted(inner_cdf, inner_target, right=True)
    return (chunk * CHUNK + column).squeeze(1)


def below(x: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """min(x, the largest float below `limit`): a target that a running sum ending at `limit` exceeds."""
    return torch.minimum(x, torch.nextafter(limit, torch.zeros_like(limit)))
