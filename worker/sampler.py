"""Turns the step's logits into tokens: one batched call for every sequence that samples this step.

Greedy rows take the argmax. Other rows divide by their temperature, keep their top_k tokens and the
smallest set whose probability reaches top_p, and draw with the exponential-race trick
(argmax(p / q), q ~ Exp(1)), which is one draw per row from the row's own generator when it has a seed.
The logprob of a chosen token is taken from the model's raw distribution (before temperature / top-k / top-p),
as vLLM reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroute.sampling import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # per row; 0.0 where the request did not ask for logprobs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed of their own

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> SamplerOutput:
        # logits: [N, vocab], one row per sampling sequence
        logits = logits.float()
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            token_ids[rows] = self._sample(
                logits[rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
        logprobs = [0.0] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            rows = torch.tensor(want)
            chosen = logits[rows].gather(1, token_ids[rows, None]).squeeze(1)
            values = (chosen - torch.logsumexp(logits[rows], dim=-1)).tolist()
            for i, value in zip(want, values, strict=True):
                logprobs[i] = value
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params])
            top_p = torch.tensor([p.top_p for p in params])
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            q[row].exponential_(generator=generator or self.generator)
        return (probs / q).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside a row's top_k (0 = off) and outside its top_p nucleus."""
    # logits: [N, V]; top_k: int [N]; top_p: float [N]
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    mask = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Keep a token while the probability before it is below top_p: the first token always stays.
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
