"""The sampler: every tensor on the logits' device, seeded draws independent of the batch, no NaN at tiny
temperatures, and logprobs / top logprobs from the model's raw distribution.

Device placement is checked without a GPU on torch's `meta` device, which refuses to mix devices in an op just
as CUDA does (a CPU tensor divided into meta logits raises); the same checks run on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampler import CANDIDATES, Sampler, draw, inverse_cdf, tempered_weights, truncate
from worker.sequence import Sequence

VOCAB = 1000
RANDOM_ROWS = [
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5, seed=3),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0),
]
LOGPROB_ROWS = [
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=True),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20),
]


def logits(rows: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)).mul(4).to(device)


def test_sampling_stays_on_the_logits_device() -> None:
    meta = torch.empty(len(RANDOM_ROWS), VOCAB, device="meta")
    uniform = torch.empty(len(RANDOM_ROWS), dtype=torch.float64, device="meta")
    top_k_rows = [SamplingParams(top_k=5), SamplingParams(temperature=0.5), SamplingParams(top_k=40, top_p=0.8)]
    assert draw(meta[:3], top_k_rows, uniform[:3]).device.type == "meta"
    top_k, top_p = torch.tensor([5, 0, 1], device="meta"), torch.tensor([1.0, 0.5, 0.9], device="meta")
    assert truncate(meta[:3], top_k, top_p).device.type == "meta"
    assert inverse_cdf(meta, uniform).device.type == "meta"
    assert tempered_weights(meta, torch.ones(len(RANDOM_ROWS), device="meta")).device.type == "meta"


def test_logprobs_stay_on_the_logits_device() -> None:
    meta = torch.empty(len(LOGPROB_ROWS), VOCAB, device="meta", dtype=torch.bfloat16)
    sampled = Sampler().sample(meta, LOGPROB_ROWS, [None] * len(LOGPROB_ROWS))
    assert sampled.logprob_rows == [0, 2, 3]
    for tensor in (sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs):
        assert tensor.device.type == "meta"
    assert sampled.top_ids.shape == (3, 20)


def test_generators_live_on_the_device_they_are_asked_for() -> None:
    sampler = Sampler(seed=7)
    cpu = torch.device("cpu")
    assert sampler.generator(cpu).device == cpu and sampler.generator(cpu) is sampler.generator(cpu)
    seeded = Sequence("r", [1, 2], SamplingParams(seed=11), hasher=None)  # type: ignore[arg-type]
    assert seeded.generator(cpu).device == cpu and seeded.generator(cpu).initial_seed() == 11
    assert Sequence("r", [1], SamplingParams(), hasher=None).generator(cpu) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [1e-4, 1e-6, 1e-30, 1e-45, 1e-300])
def test_tiny_temperatures_give_finite_probabilities_and_the_argmax(temperature: float) -> None:
    rows = logits(2) * 10  # logits up to about +-150: divided by 1e-30 they overflow float32
    rows[1, 7] = rows[1].max() + 1e-3  # a near tie at the top
    weights = tempered_weights(rows, torch.full((2,), temperature))
    assert torch.isfinite(weights).all() and weights.amax(-1).tolist() == [1.0, 1.0]
    probs = weights / weights.sum(-1, keepdim=True)
    assert probs[0].argmax() == rows[0].argmax() and probs[0].max() > 0.99
    params = [SamplingParams(temperature=temperature, top_p=0.9), SamplingParams(temperature=temperature, top_k=3)]
    assert draw(rows, params, torch.tensor([0.0, 0.999], dtype=torch.float64)).tolist() == rows.argmax(-1).tolist()
    out = Sampler()(rows, [SamplingParams(temperature=temperature)] * 2, [None, None])
    assert out.token_ids == rows.argmax(-1).tolist()


def run_seeded(rows: list[int], steps: int, batch: list[SamplingParams]) -> list[list[int]]:
    """Tokens of each row of `batch` over `steps` calls, each row with its own fresh generator when seeded."""
    sampler = Sampler(seed=0)
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in batch]
    tokens: list[list[int]] = [[] for _ in batch]
    for step in range(steps):
        out = sampler(logits(4, seed=step)[rows], batch, gens)  # the same 4 rows of logits each step
        for i, token in enumerate(out.token_ids):
            tokens[i].append(token)
    return tokens


def test_a_seeded_row_draws_the_same_tokens_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, top_k=100, seed=1234)
    alone = run_seeded([0], 20, [seeded])[0]
    crowded = run_seeded([1, 2, 0, 3], 20, [RANDOM_ROWS[0], LOGPROB_ROWS[0], seeded, RANDOM_ROWS[3]])[2]
    assert alone == crowded
    assert len(set(alone)) > 1, "it samples: a seeded row is not greedy"
    assert run_seeded([0], 20, [SamplingParams(temperature=1.0, top_k=100, seed=99)])[0] != alone


def test_draws_follow_the_truncated_distribution() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0.5, top_p=0.9)]
    uniform = torch.linspace(0, 1, 20_001, dtype=torch.float64)[:-1]  # evenly spread quantiles
    rows = row.expand(len(uniform), -1)
    counts = torch.stack([torch.bincount(draw(rows, [p] * len(uniform), uniform), minlength=6) for p in params])
    full = row.softmax(-1)
    top3 = torch.cat([full[:3] / full[:3].sum(), torch.zeros(3)])
    cooled = (row / 0.5).softmax(-1)
    # top_p 0.9: 0.83 of the mass lies before the second token (kept), 0.94 before the third (cut)
    nucleus = torch.cat([cooled[:2] / cooled[:2].sum(), torch.zeros(4)])
    for drawn, expected in zip(counts, (full, top3, nucleus), strict=True):
        torch.testing.assert_close(drawn / len(uniform), expected, atol=2e-4, rtol=0)


def test_two_level_inverse_cdf_matches_a_plain_running_sum() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 3 * 256 + 100, generator=gen) ** 8  # uneven weights, the last chunk partial
    weights[weights < 0.01] = 0.0  # many zero columns, whole zero chunks among them
    weights[:, 256:512] = 0.0
    uniform = torch.rand(64, dtype=torch.float64, generator=gen)
    uniform[:4] = torch.tensor([0.0, 1e-12, 1 - 1e-16, 0.5])
    cdf = weights.double().cumsum(-1)
    expected = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).squeeze(1)
    expected[2] = (weights[2] > 0).nonzero().max()  # the quantile just below 1 is the last token with a weight
    picks = inverse_cdf(weights, uniform)
    assert picks.tolist() == expected.tolist()
    assert bool((weights.gather(1, picks[:, None]) > 0).all())


def test_a_wide_nucleus_beyond_the_candidates_is_sampled_from_the_whole_vocabulary() -> None:
    flat = torch.zeros(2, 4 * CANDIDATES)
    flat[1, :10] = 20.0  # a peaked row in the same batch keeps its candidate path
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)]
    uniform = torch.tensor([0.999, 0.5], dtype=torch.float64)
    wide, peaked = draw(flat, params, uniform).tolist()
    assert wide >= CANDIDATES  # the 0.999 quantile of a flat nucleus of 90% of 4,096 tokens
    assert peaked < 10 and draw(flat[1:], params[1:], uniform[1:]).tolist() == [peaked]


def test_logprobs_and_top_logprobs_come_from_the_raw_distribution() -> None:
    rows = logits(4)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=2.0, logprobs=True, top_logprobs=1),
    ]
    out = Sampler()(rows, params, [None] * 4)
    raw = rows.log_softmax(-1)
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[1] == 0.0
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    for i, k in ((0, 5), (3, 1)):
        values, ids = raw[i].topk(k)
        assert out.top_logprobs[i].token_ids == ids.tolist()
        assert out.top_logprobs[i].logprobs == pytest.approx(values.tolist(), abs=1e-5)
    assert out.token_ids[0] in raw[0].topk(3).indices.tolist()
    assert Sampler()(rows, [SamplingParams(logprobs=True)] * 4, [None] * 4).top_logprobs == []


def test_engine_streams_top_logprobs_one_entry_per_token() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64))
    prompt = [(13 * j + 5) % 49152 for j in range(40)]
    asked = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_top, without = engine.generate([prompt, prompt], [asked, plain])
    assert with_top.token_ids == without.token_ids and without.top_logprobs == []
    assert len(with_top.top_logprobs) == 6
    for token, logprob, (ids, values) in zip(with_top.token_ids, with_top.logprobs, with_top.top_logprobs, strict=True):
        assert len(ids) == len(values) == 4 and values == sorted(values, reverse=True)
        assert ids[0] == token and values[0] == pytest.approx(logprob)  # greedy: the chosen token is the top one
    engine.add_request("stream", prompt, asked)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.new_top_logprobs) == len(out.new_token_ids)
    engine.check_invariants()


def test_top_logprobs_over_grpc_one_entry_per_token_and_bad_values_name_the_field() -> None:
    # Imported here: the rest of this file also runs on a bare GPU machine without the gRPC stack (gpu_check.sh).
    pytest.importorskip("grpc_health", reason="no gRPC stack here")
    import asyncio

    import grpc

    from proto import worker_pb2, worker_pb2_grpc
    from worker.service import start_worker_server

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64))
    prompt = [(11 * j + 2) % 49152 for j in range(30)]

    async def main() -> tuple[list, grpc.aio.AioRpcError]:
        server = await start_worker_server(engine, port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                sampling = worker_pb2.SamplingParams(
                    max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=True, top_logprobs=3
                )
                call = stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
                responses = [response async for response in call]
                bad = worker_pb2.SamplingParams(max_tokens=8, logprobs=True, top_logprobs=21)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Generate(worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=bad)).read()
                return responses, info.value
        finally:
            await server.stop(0)

    responses, error = asyncio.run(main())
    assert sum(len(r.token_ids) for r in responses) == 8
    for response in responses:
        assert len(response.top_logprobs) == len(response.token_ids) == len(response.logprobs)
        for top, logprob in zip(response.top_logprobs, response.logprobs, strict=True):
            assert len(top.token_ids) == len(top.logprobs) == 3 and top.logprobs[0] >= logprob
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in error.details()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_runs_on_cuda_with_seeded_rows() -> None:
    batch = RANDOM_ROWS + LOGPROB_ROWS
    rows = logits(len(batch), device="cuda")
    runs = []
    for _ in range(2):
        gens = [torch.Generator("cuda").manual_seed(p.seed) if p.seed is not None else None for p in batch]
        out = Sampler()(rows, batch, gens)
        assert all(0 <= t < VOCAB for t in out.token_ids) and out.token_ids[4:] == rows[4:].argmax(-1).tolist()
        assert len(out.top_logprobs[7].token_ids) == 20
        runs.append(out.token_ids)
    assert runs[0][1] == runs[1][1], "the seeded row draws the same token from a fresh generator"


def test_suppressed_tokens_are_never_picked_and_logprobs_stay_raw() -> None:
    rows = logits(3)
    best = rows.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=1, top_k=1), SamplingParams()]
    suppressed = [(best[0],), (best[1],), ()]
    out = Sampler(0)(rows, params, [None] * 3, suppressed)
    assert out.token_ids[0] != best[0] and out.token_ids[1] != best[1], "argmax and top-k=1 skip the banned token"
    raw = torch.log_softmax(rows[0], dim=-1)[out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(raw, abs=1e-4), "the logprob is the model's, before suppression"
