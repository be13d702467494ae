"""The engine on the tiny model and the sim runner: scheduling, prefix caching, preemption, cancellation,
sampling and input validation, with the block-pool invariants checked after every step."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvroute.sampling import InvalidRequest, SamplingParams
from launch.cli import main as cli_main
from worker.config import EngineConfig
from worker.engine import LLMEngine, RequestOutput
from worker.model.tiny import tiny_config
from worker.model_runner import kv_bytes_per_block
from worker.sampler import Sampler, truncate
from worker.sequence import Sequence

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to gain from a second thread, and on a shared machine each parallel
    op can stall waiting for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(**overrides) -> LLMEngine:
    fields = dict(model="tiny", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64)
    return LLMEngine(EngineConfig(**(fields | overrides)))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run_checked(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle, checking the invariants after every step; outputs grouped by request."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_blocks_used == 0, "every block is free once nothing runs"
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_prefix_caching_preemption_and_chunking_do_not_change_tokens() -> None:
    prompts = random_prompts([5, 17, 33, 64, 100, 3, 48, 90])
    baseline = make_engine(enable_prefix_caching=False, max_num_batched_tokens=4096)
    expected = [r.token_ids for r in baseline.generate(prompts, GREEDY)]
    variants = {
        "prefix caching, chunks of 64": make_engine(),
        "tiny pool (preempts)": make_engine(num_kv_blocks=14, max_num_batched_tokens=32, decode_reserve_tokens=0),
    }
    for name, engine in variants.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
        outputs = run_checked(engine)
        assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))] == expected, name
    assert variants["tiny pool (preempts)"].stats().num_preemptions > 0


def test_warm_up_leaves_no_trace() -> None:
    prompts = random_prompts([5, 40])
    expected = [r.token_ids for r in make_engine().generate(prompts, GREEDY)]
    engine = make_engine()
    engine.warm_up()
    assert all(int(k.count_nonzero()) == 0 == int(v.count_nonzero()) for k, v in engine.runner.kv_caches)
    assert engine.stats().prefix_queries == 0 and not engine.drain_kv_events()
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    engine.check_invariants()
    make_engine(model="sim").warm_up()


def test_prompt_logits_scores_one_step_and_leaves_nothing_running() -> None:
    engine = make_engine()
    prompt = random_prompts([40])[0]
    full = engine.prompt_logits(prompt)
    assert full.shape == (40, 49152) and full.dtype == torch.float32
    assert engine.prompt_logits(prompt).shape[0] == 40  # it caches nothing itself
    engine.generate([prompt], GREEDY)  # a real request leaves 32 tokens cached: the step computes the last 8
    torch.testing.assert_close(engine.prompt_logits(prompt), full[32:], atol=1e-4, rtol=1e-4)
    assert not engine.has_unfinished_requests() and engine.stats().num_blocks_used == 0
    engine.check_invariants()
    with pytest.raises(ValueError, match="more than one step"):
        engine.prompt_logits(random_prompts([100])[0])  # max_num_batched_tokens is 64
    engine.add_request("busy", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.prompt_logits(prompt)
    with pytest.raises(RuntimeError, match="needs a model"):
        make_engine(model="sim").prompt_logits(prompt)


def test_cached_prefix_is_reused_and_gives_the_same_tokens() -> None:
    engine = make_engine()
    prompt = random_prompts([70])[0]
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 64  # four full blocks; the last prompt token is always computed
    assert second.token_ids == first.token_ids
    stats = engine.stats()
    assert stats.prefix_queries == 140 and stats.prefix_hits == 64
    # The answer's blocks are cached too: prompt + answer as the next turn's prefix hits beyond the prompt.
    third = engine.generate([prompt + first.token_ids + [7, 8, 9]], GREEDY)[0]
    assert third.cached_tokens == (70 + 24) // 16 * 16
    engine.check_invariants()


def test_cache_salt_isolates_tenants() -> None:
    engine = make_engine()
    prompt = random_prompts([40])[0]
    for salt, expected_cached in (("a", 0), ("b", 0), ("a", 32)):
        engine.add_request(f"req-{salt}-{expected_cached}", prompt, GREEDY, cache_salt=salt)
        outputs = run_checked(engine)
        assert outputs[f"req-{salt}-{expected_cached}"][0].cached_tokens == expected_cached


def test_abort_mid_prefill_and_mid_decode_frees_blocks() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    long_prompt, short_prompt = random_prompts([100, 10])
    engine.add_request("decoding", short_prompt, GREEDY)
    engine.add_request("prefilling", long_prompt, GREEDY)
    outputs: list[RequestOutput] = []
    for _ in range(2):
        outputs += engine.step()
        engine.check_invariants()
    assert engine.stats().num_running == 2
    engine.abort_request("prefilling")  # 21 of its 100 prompt tokens are computed
    engine.check_invariants()
    for _ in range(3):
        outputs += engine.step()
    engine.abort_request("decoding")
    engine.abort_request("unknown-id")  # a no-op
    engine.check_invariants()
    outputs += engine.step()
    assert not engine.has_unfinished_requests() and engine.stats().num_blocks_used == 0
    finals = {out.request_id: out.finish_reason for out in outputs if out.finished}
    assert finals == {"prefilling": "abort", "decoding": "abort"}
    assert len(tokens_of([o for o in outputs if o.request_id == "decoding"])) == 5


def test_abort_while_waiting() -> None:
    engine = make_engine(max_num_seqs=1)
    a, b = random_prompts([20, 20])
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    first_step = engine.step()
    assert engine.stats().num_waiting == 1
    engine.abort_request("b")
    outputs = run_checked(engine)
    assert len(first_step + outputs["a"]) == 24 and outputs["b"][0].finish_reason == "abort"


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 5000, SamplingParams(), "prompt"),
        ([1, 49152], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([1, 2**32], SamplingParams(), "prompt_token_ids"),  # past uint32: the fast check's fallback names it
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(max_tokens=4090), "max_tokens"),
        ([1], SamplingParams(max_tokens=5000), "max_tokens"),  # more KV blocks than the pool holds
        ([1], SamplingParams(temperature=-0.5), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_p=1.5), "top_p"),
        ([1], SamplingParams(top_k=-1), "top_k"),
        ([1], SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs"),
        ([1], SamplingParams(logprobs=True, top_logprobs=-1), "top_logprobs"),
        ([1], SamplingParams(top_logprobs=5), "top_logprobs"),  # without logprobs
        ([1], SamplingParams(stop_token_ids=tuple(range(129))), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(prompt, params, field) -> None:
    engine = make_engine()
    engine.add_request("good", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field
    with pytest.raises(InvalidRequest, match="request_id"):
        engine.add_request("good", [1, 2, 3], GREEDY)
    outputs = run_checked(engine)
    assert set(outputs) == {"good"} and len(tokens_of(outputs["good"])) == 24


def test_stop_tokens_eos_and_max_tokens() -> None:
    engine = make_engine()
    prompt = random_prompts([12])[0]
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[5]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids == free_run[: free_run.index(stop_at) + 1] and stopped.finish_reason == "stop"
    capped = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert capped.token_ids == free_run[:3] and capped.finish_reason == "length"


def test_min_tokens_holds_back_stop_tokens_and_eos() -> None:
    engine = make_engine()
    prompt = random_prompts([12])[0]
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[1]
    held = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_at,), min_tokens=6)
    out = engine.generate([prompt], held)[0]
    assert stop_at not in out.token_ids[:6] and len(out.token_ids) > 6, "no stop token before min_tokens"
    assert out.finish_reason == "length" or out.token_ids.index(stop_at) == len(out.token_ids) - 1
    eos = next(iter(engine.eos_token_ids))
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(5,))
    seq = Sequence("r", [1, 2], params, hasher=None, eos_token_ids=frozenset({eos}))  # type: ignore[arg-type]
    assert seq.suppressed_token_ids() == tuple(sorted({5, eos})), "stop ids and EOS, until min_tokens"
    seq.token_ids += [7, 7, 7]
    assert seq.suppressed_token_ids() == ()
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


def test_sampling_is_seeded_batched_and_logprobs_are_the_models() -> None:
    engine = make_engine()
    prompts = random_prompts([10, 30, 50])
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    one = engine.generate(prompts, seeded)
    two = engine.generate(prompts, seeded)
    assert [r.token_ids for r in one] == [r.token_ids for r in two]
    greedy_lp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    top1 = SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=5, ignore_eos=True, logprobs=True)
    greedy_result, top1_result = engine.generate([prompts[0], prompts[0]], [greedy_lp, top1])
    assert top1_result.token_ids == greedy_result.token_ids
    assert len(greedy_result.logprobs) == 8 and all(lp <= 0 for lp in greedy_result.logprobs)
    assert greedy_result.logprobs == pytest.approx(top1_result.logprobs, abs=1e-5)
    assert one[0].logprobs == []  # not asked for


def test_sampler_top_k_top_p_masks() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    values, _ = logits.softmax(-1).sort(dim=-1, descending=True)
    kept = truncate(values, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]))
    assert (kept > 0).tolist() == [[True, True, False, False], [True, False, False, False]]
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=1.0, top_k=1)]
    out = sampler(logits, params, [None, None])
    assert out.token_ids == [0, 2]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())


def test_fp8_kv_cache_holds_twice_the_blocks_of_bf16() -> None:
    config = tiny_config()
    bf16 = kv_bytes_per_block(config, 16, torch.bfloat16)
    fp8 = kv_bytes_per_block(config, 16, torch.float8_e4m3fn)
    assert bf16 == 2 * fp8 == 2 * (2 * config.num_hidden_layers * 16 * config.num_key_value_heads * config.head_dim)
    engine = make_engine(kv_cache_dtype="fp8", num_kv_blocks=None, kv_cache_memory_gb=0.01, dtype="bfloat16")
    assert engine.runner.num_kv_blocks == int(0.01 * 2**30) // fp8
    result = engine.generate(random_prompts([40]), GREEDY)[0]
    assert len(result.token_ids) == 24
    engine.check_invariants()


def test_sim_engine_is_deterministic_and_uses_the_real_block_manager() -> None:
    engine = LLMEngine(EngineConfig(model="sim", num_kv_blocks=64, max_num_batched_tokens=64))
    prompts = random_prompts([40, 40, 7], vocab=engine.vocab_size)
    params = SamplingParams(max_tokens=5)
    first = engine.generate(prompts, params)
    second = engine.generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert all(len(r.token_ids) == 5 and r.finish_reason == "length" for r in first)
    assert second[0].cached_tokens == 32
    assert engine.drain_kv_events(), "cached blocks emit stored events"
    engine.check_invariants()


def test_cli_generate_json_reports_cached_tokens(capsys) -> None:
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
    code = cli_main(["generate", "--model", "tiny", "--prompt", text, "--prompt", text, "--max-tokens", "4", "--json"])
    assert code == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) <= 4
    assert first["cached_tokens"] == 0 and second["cached_tokens"] > 0
    assert set(first) == {"token_ids", "text", "prompt_tokens", "cached_tokens"}


def test_cli_generate_bad_input_is_one_line(capsys) -> None:
    assert cli_main(["generate", "--model", "tiny", "--prompt", "", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "prompt" in err
    assert cli_main(["generate", "--model", "tiny", "--prompt", "hi", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert cli_main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    assert "model" in capsys.readouterr().err


def test_a_preempted_request_keeps_its_first_cached_figure_and_counts_one_prefix_query() -> None:
    """Re-admission after a preemption looks the prefix up over prompt + output; it must not report that as
    cached prompt tokens (more than the prompt) nor count a second prefix query."""
    from worker.clock import VirtualClock
    from worker.sim_runner import SimRunner

    config = EngineConfig(
        model="sim", num_kv_blocks=8, block_size=4, max_num_batched_tokens=64, watermark=0.0, decode_reserve_tokens=0
    )
    runner = SimRunner(config, clock=VirtualClock(), outputs=lambda seq: 7)
    engine = LLMEngine(config, clock=runner.clock, sim_runner=runner)
    params = SamplingParams(max_tokens=14)
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=1))  # caches block [1, 2, 3, 4]
    before = engine.stats()
    prompts = [[1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14]]  # both grow to 20 tokens: 5 blocks each, 8 in all
    results = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions > before.num_preemptions
    assert [r.prompt_tokens for r in results] == [6, 6]
    assert [r.cached_tokens for r in results] == [4, 0]  # the first admission's figures
    assert stats.prefix_queries - before.prefix_queries == 12  # one query per request, in prompt tokens
    assert stats.prefix_hits - before.prefix_hits == 4
    engine.check_invariants()
