"""The request path's parts on their own: stop strings over real SmolLM2 tokens, circuit breakers, retry
backoff, API keys and tenant salts, the prefix doctor's live metrics."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from gateway.admission.auth import OPEN_TENANT, Authenticator, cache_salt, key_sha256, tenant_salt
from gateway.admission.limits import Limits
from gateway.errors import AuthenticationError, RateLimited
from gateway.fleet.fleet_state import BookkeepingFleetState, FleetIdentity
from gateway.forwarding.retry import BreakerState, CircuitBreakers, RetryPolicy
from gateway.forwarding.stop_strings import ChoiceText, StopStringMatcher
from gateway.metrics import GatewayMetrics
from gateway.request import GatewayRequest, Tenant
from gateway.request_path import TOKENIZE_BACKLOG, RequestPath
from gateway.routing.router import make_policy
from kvroute.tokenizer import Tokenizer

# -- stop strings ------------------------------------------------------------------------------------------------


def stream(matcher: StopStringMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "matched"),
    [
        (["Hello", "\n", "\nUs", "er: hi"], ["\n\nUser:"], "Hello", "\n\nUser:"),
        (["ab", "c", "d"], ["cd", "bc"], "a", "bc"),  # the earliest match wins, whichever stop it is
        (["a", "b", "x"], ["abc"], "abx", None),  # a held partial match that fails is released
        (["The end"], ["."], "The end", None),
        (["x.", "y"], ["."], "x", "."),
    ],
)
def test_stop_strings_match_across_pieces(
    pieces: list[str], stops: list[str], expected: str, matched: str | None
) -> None:
    matcher = StopStringMatcher(stops)
    assert stream(matcher, pieces) == expected
    assert matcher.matched == matched


def test_only_a_possible_stop_prefix_is_held_back() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("ay") == "STay"
    assert matcher.feed("no stop here") == "no stop here"


def test_choice_text_is_right_across_multi_byte_characters(tokenizer_smollm2: Tokenizer) -> None:
    text = "naïve 🎉 café — 日本語 END rest"
    ids = tokenizer_smollm2.encode(text)
    choice = ChoiceText(tokenizer_smollm2, ["END"])
    out = ""
    for token_id in ids:
        out += choice.add([token_id])
        assert "\ufffd" not in out
        if choice.stopped:
            break
    assert choice.stopped and out == "naïve 🎉 café — 日本語 "


def test_stop_strings_wait_for_min_tokens(tokenizer_smollm2: Tokenizer) -> None:
    ids = tokenizer_smollm2.encode("END one END two")
    first_end = len(tokenizer_smollm2.encode("END"))
    choice = ChoiceText(tokenizer_smollm2, ["END"], min_tokens=first_end + 1)
    out = "".join(choice.add([t]) for t in ids)
    assert choice.stopped and out == "END one ", "the first END came before min_tokens; the second stops"


# -- breakers and retries ------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_k_failures_probes_once_and_closes_on_success() -> None:
    clock = Clock()
    breakers = CircuitBreakers(failure_threshold=3, cooldown_s=5.0, clock=clock)
    for _ in range(2):
        breakers.on_dispatch("w1")
        breakers.on_failure("w1")
    assert breakers.blocked() == frozenset() and breakers.state("w1") is BreakerState.CLOSED
    breakers.on_failure("w1")
    assert breakers.blocked() == {"w1"} and breakers.state("w1") is BreakerState.OPEN
    clock.now = 5.0
    assert breakers.blocked() == frozenset() and breakers.state("w1") is BreakerState.HALF_OPEN
    breakers.on_dispatch("w1")  # the probe
    assert breakers.blocked() == {"w1"}  # nobody else until it is decided
    breakers.on_failure("w1")
    assert breakers.state("w1") is BreakerState.OPEN
    clock.now = 10.0
    breakers.on_dispatch("w1")
    breakers.on_abandoned("w1")  # the client left: the probe may be sent again
    assert breakers.blocked() == frozenset()
    breakers.on_dispatch("w1")
    breakers.on_success("w1")
    assert breakers.state("w1") is BreakerState.CLOSED and breakers.states() == {}


def test_a_success_resets_the_failure_count() -> None:
    breakers = CircuitBreakers(failure_threshold=2)
    breakers.on_failure("w1")
    breakers.on_success("w1")
    breakers.on_failure("w1")
    assert breakers.state("w1") is BreakerState.CLOSED


def test_a_worker_that_leaves_or_restarts_has_its_breaker_and_channel_reset(tokenizer_smollm2: Tokenizer) -> None:
    from gateway.fleet.fleet_state import FleetBook, FleetIdentity
    from gateway.request_path import RequestPath
    from gateway.routing.router import make_policy

    async def body() -> None:
        identity = FleetIdentity("m", 16, "h", "t")
        fleet = _BookFleet(identity)
        path = RequestPath(
            fleet, make_policy("round_robin"), tokenizer_smollm2, "m", "m", Authenticator(), Limits(),
            GatewayMetrics("m"), breakers=CircuitBreakers(failure_threshold=1),
        )  # fmt: skip
        book: FleetBook = fleet.book
        for worker_id, address in (("w0", "127.0.0.1:1"), ("w1", "127.0.0.1:2")):
            book.admit(worker_id, address, 1, "m", 16, 4096, "h", "t")
            path.clients.stub(address)
            path.breakers.on_failure(worker_id)
        assert path.breakers.blocked() == {"w0", "w1"}
        book.admit("w0", "127.0.0.1:1", 2, "m", 16, 4096, "h", "t")  # restarted at the same address
        assert path.breakers.blocked() == {"w1"}, "a restarted worker is routable at once"
        assert path.clients.addresses == {"127.0.0.1:1", "127.0.0.1:2"}, "its channel reconnects, kept"
        book.admit("w0", "127.0.0.1:3", 3, "m", 16, 4096, "h", "t")  # restarted elsewhere (a new pod IP)
        assert path.clients.addresses == {"127.0.0.1:2"}, "the old address's channel is closed"
        book.leave("w1", "test")
        assert path.breakers.blocked() == frozenset() and path.clients.addresses == frozenset()
        await path.close()

    asyncio.run(body())


def _tokenizer_path(tokenizer: Tokenizer, limits: Limits | None = None) -> RequestPath:
    """A request path over no worker (what /tokenize and /detokenize need), with one key held to 1 request."""
    auth = Authenticator([
        {"tenant": "small", "key_sha256": key_sha256("sk-small"), "max_concurrency": 1},
        {"tenant": "big", "key_sha256": key_sha256("sk-big")},
    ])  # fmt: skip
    fleet = _BookFleet(FleetIdentity("m", 16, "h", "t"))
    return RequestPath(
        fleet, make_policy("round_robin"), tokenizer, "m", "m", auth, limits or Limits(), GatewayMetrics("m")
    )


def test_tokenize_and_detokenize_take_the_tenants_slot(tokenizer_smollm2: Tokenizer) -> None:
    async def body() -> None:
        path = _tokenizer_path(tokenizer_smollm2)
        tenant = path.auth.authenticate("sk-small")
        request = GatewayRequest(api_key="sk-small", model=None, prompt="hello " * 600)  # tokenized in the pool
        path.concurrency.acquire(tenant)  # its one request is in flight
        with pytest.raises(RateLimited, match="1 requests in flight"):
            await path.tokenize(request)
        with pytest.raises(RateLimited, match="1 requests in flight"):
            await path.detokenize("sk-small", None, [1, 2, 3])
        path.concurrency.release(tenant)
        ids = (await path.tokenize(request)).token_ids
        assert await path.detokenize("sk-small", None, ids) == "hello " * 600
        assert not path.concurrency.in_flight, "each call gave its slot back"
        await path.close()

    asyncio.run(body())


def test_tokenize_requests_waiting_for_the_prompt_pool_are_bounded(tokenizer_smollm2: Tokenizer) -> None:
    async def body() -> None:
        path = _tokenizer_path(tokenizer_smollm2)
        request = GatewayRequest(api_key="sk-big", model=None, prompt="a long prompt " * 300)
        results = await asyncio.gather(
            *(path.tokenize(request) for _ in range(TOKENIZE_BACKLOG + 2)), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, RateLimited)]
        assert len(refused) == 2 and "/tokenize requests are being tokenized" in refused[0].message
        assert len((await path.tokenize(request)).token_ids) == len(results[0].token_ids), "the bound frees"
        await path.close()

    asyncio.run(body())


def test_long_detokenize_and_block_hashing_leave_the_event_loop_free(tokenizer_smollm2: Tokenizer) -> None:
    async def body() -> None:
        count = 400_000
        path = _tokenizer_path(tokenizer_smollm2, Limits(max_prompt_tokens=count, max_tokens=16))
        ids = [(i * 7919) % 40_000 + 100 for i in range(count)]
        gaps = [0.0]

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        await path.detokenize("sk-big", None, ids)
        prepared = await path.prepare(GatewayRequest("sk-big", None, prompt_token_ids=ids, kind="tokens"))
        took = time.perf_counter() - started
        path.concurrency.release(prepared.tenant)
        ticker.cancel()
        assert len(prepared.hashes) == count // 16
        assert max(gaps) < took / 4, f"the loop stalled {max(gaps) * 1e3:.0f} ms of {took * 1e3:.0f} ms"
        await path.close()

    asyncio.run(body())


def test_front_doors_mark_a_max_tokens_the_client_did_not_set() -> None:
    from gateway.frontdoors.grpc_server import gateway_request_from_proto
    from gateway.frontdoors.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestHeaders
    from proto import gateway_pb2

    headers = RequestHeaders()
    chat = [{"role": "user", "content": "hi"}]
    defaulted = ChatCompletionRequest(messages=chat).to_gateway_request(headers, default_max_tokens=100)
    assert (defaulted.params.max_tokens, defaulted.max_tokens_defaulted) == (100, True)
    chosen = ChatCompletionRequest(messages=chat, max_completion_tokens=100).to_gateway_request(headers, 100)
    assert (chosen.params.max_tokens, chosen.max_tokens_defaulted) == (100, False)
    assert CompletionRequest(prompt="hi").to_gateway_request(headers).max_tokens_defaulted
    assert not CompletionRequest(prompt="hi", max_tokens=16).to_gateway_request(headers).max_tokens_defaulted
    message = gateway_pb2.GatewayGenerateRequest(prompt="hi")
    assert gateway_request_from_proto(message, headers, 100).max_tokens_defaulted
    message.sampling.max_tokens = 16
    assert not gateway_request_from_proto(message, headers, 100).max_tokens_defaulted


def test_backoff_is_full_jitter_under_a_growing_cap() -> None:
    policy = RetryPolicy(retries=3, backoff_base_s=0.01, backoff_cap_s=0.025)
    rng = random.Random(0)
    for attempt, ceiling in ((1, 0.01), (2, 0.02), (3, 0.025), (4, 0.025)):
        delays = [policy.backoff(attempt, rng) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= ceiling and max(delays) > 0.8 * ceiling
    with pytest.raises(ValueError, match="--retries"):
        RetryPolicy(retries=-1)


# -- API keys and salts ----------------------------------------------------------------------------------------------


def test_keys_map_to_tenants_with_server_side_salts(tmp_path) -> None:
    entries = [
        {"tenant": "acme", "key_sha256": key_sha256("k1"), "max_concurrency": 4},
        {"tenant": "acme", "key_sha256": key_sha256("k2")},
        {"tenant": "globex", "key_sha256": key_sha256("k3")},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    auth = Authenticator.from_config(str(path), environ={}, allow_derived_salt=True)
    acme = auth.authenticate("k1")
    assert acme == auth.authenticate("k2") == Tenant("acme", tenant_salt("acme"), 4)
    globex = auth.authenticate("k3")
    assert globex.cache_salt != acme.cache_salt and len(acme.cache_salt) == 64
    for bad in (None, "", "k4", "k1 "):
        with pytest.raises(AuthenticationError):
            auth.authenticate(bad)
    # The secret makes salts unguessable; every gateway with it derives the same ones.
    env = {"KVROUTE_API_KEYS": json.dumps(entries), "KVROUTE_CACHE_SALT_SECRET": "s3cret"}
    secret_auth = Authenticator.from_config(None, environ=env)
    assert secret_auth.authenticate("k1").cache_salt == tenant_salt("acme", b"s3cret") != acme.cache_salt
    # A client's salt goes under the tenant's, so no client can reach another tenant's (or the open) salt.
    assert cache_salt(acme, "x").startswith(acme.cache_salt + "\x00") and cache_salt(acme, "") == acme.cache_salt
    assert Authenticator.from_config(None, environ={}).authenticate(None) == OPEN_TENANT


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"tenant": "a"}, "must be a JSON list"),
        ([{"tenant": "", "key_sha256": "0" * 64}], r"api keys\[0\]\.tenant"),
        ([{"tenant": "a", "key_sha256": "abc"}], r"api keys\[0\]\.key_sha256: must be 64 hex digits"),
        ([{"tenant": "a", "key_sha256": "0" * 64, "max_concurrency": 0}], r"max_concurrency: must be an integer >= 1"),
        ([{"tenant": "a", "key_sha256": "0" * 64, "rate": 1}], "unknown field 'rate'"),
        ([{"tenant": "a", "key_sha256": "0" * 64}, {"tenant": "b", "key_sha256": "0" * 64}], "listed twice"),
    ],
)
def test_bad_key_files_are_refused_with_the_field(entries: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Authenticator.from_config(None, environ={"KVROUTE_API_KEYS": json.dumps(entries)})


# -- the prefix doctor's live half ------------------------------------------------------------------------------------


def test_divergence_and_hit_rate_per_app() -> None:
    metrics = GatewayMetrics("m", tenant_labels=True)
    tenant = Tenant("acme", "salt")
    a = [bytes([i]) for i in range(10)]
    metrics.observe_prefix(tenant, "chat", a, matched_blocks=0, block_size=16)
    metrics.observe_prefix(tenant, "chat", a[:6] + [b"x"] * 4, matched_blocks=6, block_size=16)
    text = metrics.render().decode()
    assert 'kvroute:prefix_divergence_tokens_sum{app="chat",tenant="acme"} 96.0' in text  # 6 blocks of 16
    assert 'kvroute:prefix_hit_rate{app="chat",tenant="acme"} 0.3' in text  # 6 of 20 blocks


class _BookFleet(BookkeepingFleetState):
    """A fleet state fed by the test itself through its book (no worker is dialled)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def on_failure(self, worker_id: str) -> None: ...
