"""A worker request of each choice (gateway/forwarding/backends.py's `generate_request`): the client's sampling
parameters, each choice with its own seed, the job's own parameters untouched, and its effective priority."""

from __future__ import annotations

import pytest

from gateway.forwarding.backends import ForwardJob, generate_request
from gateway.request import GatewayRequest
from kvroute.sampling import SamplingParams


@pytest.mark.parametrize("seed", [None, 7, 2**63 - 1, -(2**63)])
def test_each_choice_gets_its_seed_and_the_rest_of_the_parameters(seed: int | None) -> None:
    params = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, seed=seed, stop_token_ids=[3])
    request = GatewayRequest(None, None, prompt_token_ids=[1, 2], params=params, kind="tokens", n=3)
    job = ForwardJob("r", request, [1, 2], "salt", [b"h"], params, {"traceparent": "t"}, priority=-3)
    for choice in range(3):
        sent = generate_request(job, choice)
        assert sent.request_id == ("r" if choice == 0 else f"r-{choice}")
        expected = None if seed is None else (seed + choice + 2**63) % 2**64 - 2**63
        assert (sent.sampling.seed if sent.sampling.HasField("seed") else None) == expected
        assert (sent.sampling.max_tokens, sent.sampling.top_k, list(sent.sampling.stop_token_ids)) == (9, 4, [3])
        assert sent.cache_salt == "salt" and dict(sent.trace_context) == {"traceparent": "t"}
        assert sent.HasField("priority") and sent.priority == -3
    assert job.params is params and params.seed == seed
