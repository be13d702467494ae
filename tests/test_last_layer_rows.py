"""The model's last layer runs attention, o_proj and the MLP only on the rows a step samples (worker/model/llama.py's
`OutputRows`): the engine's sampled logits and greedy tokens match those of the full last layer, on every
attention backend, and the KV cache it leaves is the same.

The Triton backend runs under Triton's interpreter on CPU, read when its kernels are first imported (as in
tests/test_engine_triton.py).
"""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvroute.sampling import SamplingParams  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from worker.model_runner import ModelRunner, StepInputs  # noqa: E402
from worker.scheduler import SchedulerOutput  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BACKENDS = [
    "torch",
    "cpu",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available(),
            reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
        ),
    ),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in lengths]


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[int]]  # request id -> generated tokens
    step_logits: list[torch.Tensor]  # each step's sampled logits
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    narrowed: int = 0  # steps whose last layer ran on the sampled rows only
    no_row: int = 0  # of those, steps that sampled nothing (mid-prompt chunks only)


def run_engine(backend: str, max_num_batched_tokens: int, skip: bool) -> Run:
    """Four prompts arriving one step apart (later ones prefill, in chunks when the budget is small, while earlier
    ones decode), then a prompt alone; with `skip` False the runner keeps every row in the last layer."""
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        attention_backend=backend,
        device="cpu",
        num_kv_blocks=64,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    run = Run({}, [], runner.kv_caches)
    prepare, compute = runner.prepare_inputs, runner.compute_logits

    def prepare_inputs(batch: SchedulerOutput) -> StepInputs:
        inputs = prepare(batch)
        if inputs.sampled_only is not None:
            run.narrowed += 1
            run.no_row += inputs.sampled_only.meta is None
        return inputs if skip else dataclasses.replace(inputs, sampled_only=None)

    def compute_logits(batch: SchedulerOutput, every_row: bool = False) -> torch.Tensor:
        logits = compute(batch, every_row)
        run.step_logits.append(logits)
        return logits

    runner.prepare_inputs, runner.compute_logits = prepare_inputs, compute_logits
    arrivals = list(enumerate(prompts([40, 7, 23, 61, 50])))
    while arrivals or engine.has_unfinished_requests():
        if arrivals and (len(arrivals) > 1 or not engine.has_unfinished_requests()):
            i, prompt = arrivals.pop(0)
            engine.add_request(f"r{i}", prompt, GREEDY)
        for out in engine.step():
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_invariants()
    return run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_num_batched_tokens", [16, 4096])
def test_sampled_rows_only_give_the_full_last_layers_logits(backend: str, max_num_batched_tokens: int) -> None:
    ours = run_engine(backend, max_num_batched_tokens, skip=True)
    reference = run_engine(backend, max_num_batched_tokens, skip=False)
    assert ours.narrowed > 0
    assert ours.no_row > 0 if max_num_batched_tokens == 16 else ours.no_row == 0
    assert ours.tokens == reference.tokens
    assert len(ours.step_logits) == len(reference.step_logits)
    for step, (got, expected) in enumerate(zip(ours.step_logits, reference.step_logits, strict=True)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    # Every row's K/V reached the cache, skipped rows' included: the same cache, bit for bit.
    for (k, v), (k_ref, v_ref) in zip(ours.kv_caches, reference.kv_caches, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
