"""The engine on the Triton attention backend gives the torch backend's greedy tokens (issue 4's switch).

On CPU the kernels run under Triton's interpreter, which triton.jit reads when the kernel modules are first
imported, so the variable is set before anything imports them.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvroute.sampling import SamplingParams  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT = "The paged attention kernel reads keys and values through the block table of each sequence."


def run_engine(backend: str, kv_cache_dtype: str, prompts: list[list[int]]) -> list:
    config = EngineConfig(
        model="tiny", attention_backend=backend, kv_cache_dtype=kv_cache_dtype, device=DEVICE, num_kv_blocks=64
    )
    engine = LLMEngine(config)
    results = [engine.generate([p], GREEDY)[0] for p in prompts]  # one by one: later prompts hit the cache
    engine.check_invariants()
    return results


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_backend_gives_the_torch_backends_tokens(kv_cache_dtype):
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=4))
    prompt = engine.tokenizer.encode(PROMPT)
    extended = prompt + engine.tokenizer.encode(" The decode kernel splits long contexts.")
    torch_results = run_engine("torch", kv_cache_dtype, [prompt, extended])
    triton_results = run_engine("triton", kv_cache_dtype, [prompt, extended])
    assert triton_results[1].cached_tokens > 0  # the second prompt runs over a cached prefix
    for ours, reference in zip(triton_results, torch_results, strict=True):
        assert ours.cached_tokens == reference.cached_tokens
        assert ours.token_ids == reference.token_ids
