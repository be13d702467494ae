"""Workers trust only their gateways (issue 19, item 9): a worker started with a token refuses every
`kvroute.v1.Worker` call without it (health excepted), gateways present it, the fleet's secrets come from
files and never from a command line, the gateway refuses API keys without a cache-salt secret, and KV
snapshots come in bounded pages at a bounded rate. Real workers (sim engines) behind real gRPC servers, the
real embedded fleet state, and `kvroute worker` / `kvroute gateway` processes over a real redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admission.auth import key_sha256, tenant_salt
from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.request_path import fleet_identity
from gateway.worker_client import worker_stub
from kvroute.credentials import generate_secret
from kvroute.sampling import SamplingParams
from launch import cli
from launch.fleet import Fleet, free_port, kvroute_argv
from launch.redis_server import RedisServer
from proto import worker_pb2, worker_pb2_grpc
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server
from worker.sim_runner import SimCostModel

TOKEN = generate_secret()
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def sim_engine(num_kv_blocks: int = 256, max_model_len: int = 512) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(model="sim", num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, max_num_seqs=64)
    )
    engine.runner.cost = SimCostModel(prefill_us_per_token=0.0, decode_ms_per_step=1.0)
    return engine


@asynccontextmanager
async def worker(engine: LLMEngine, **options: Any) -> AsyncIterator[tuple[WorkerServer, grpc.aio.Channel]]:
    server = await start_worker_server(engine, port=0, **options)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, channel
    finally:
        await server.stop(drain_timeout=0)


async def code_of(call: Any) -> grpc.StatusCode | None:
    """The status a unary call or a whole stream ends with (None: OK)."""
    try:
        result = await call if not hasattr(call, "read") else [r async for r in call]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    assert result is not None
    return None


def generate_request(prompt: list[int], cache_salt: str = "") -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        prompt_token_ids=prompt, cache_salt=cache_salt, sampling=worker_pb2.SamplingParams(max_tokens=2)
    )


def test_every_worker_method_refuses_a_call_without_the_token_and_health_stays_open() -> None:
    """The issue's attack: a client on the worker port computes tenant A's salt (derived from its name, no
    secret) and sends A's prompt. Without the token it gets UNAUTHENTICATED and no usage, on every method;
    with the token the same call would have shown A's cached tokens."""
    prompt = [100 + i for i in range(64)]  # 4 full blocks
    salt_a = tenant_salt("tenant-a")

    async def main() -> None:
        async with worker(sim_engine(), auth_token=TOKEN) as (server, channel):
            gateway = worker_stub(channel, TOKEN)
            first = [r async for r in gateway.Generate(generate_request(prompt, salt_a))]
            assert first[-1].usage.cached_tokens == 0
            anonymous = worker_pb2_grpc.WorkerStub(channel)
            for metadata in (None, (("authorization", f"Bearer {TOKEN[:-1]}"),), (("authorization", TOKEN),)):
                calls = {
                    "GetInfo": anonymous.GetInfo(worker_pb2.GetInfoRequest(), metadata=metadata),
                    "GetStats": anonymous.GetStats(worker_pb2.GetStatsRequest(), metadata=metadata),
                    "GetKVEvents": anonymous.GetKVEvents(worker_pb2.GetKVEventsRequest(), metadata=metadata),
                    "Generate": anonymous.Generate(generate_request(prompt, salt_a), metadata=metadata),
                }
                codes = {name: await code_of(call) for name, call in calls.items()}
                assert codes == dict.fromkeys(calls, UNAUTHENTICATED), metadata
            try:
                async for _ in anonymous.Generate(generate_request(prompt, salt_a)):
                    raise AssertionError("an anonymous Generate streamed a reply")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == UNAUTHENTICATED and "worker token" in (exc.details() or "")
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            # The gateway's token is accepted on every method, and the salt was the right one to steal.
            again = [r async for r in gateway.Generate(generate_request(prompt, salt_a))]
            assert again[-1].usage.cached_tokens == 48
            assert (await gateway.GetInfo(worker_pb2.GetInfoRequest())).worker_id == server.worker_id
            assert (await gateway.GetStats(worker_pb2.GetStatsRequest())).prompt_tokens_total == 128
            assert (await gateway.GetKVEvents(worker_pb2.GetKVEventsRequest())).latest_seq >= 1

    asyncio.run(main())


def test_a_gateway_fleet_without_the_token_admits_no_worker_and_one_with_it_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        engine = sim_engine()
        async with worker(engine, auth_token=TOKEN) as (server, _):
            identity = fleet_identity(engine.model_id, engine.tokenizer)
            for token, members in ((None, 0), ("x" * 32, 0), (TOKEN, 1)):
                fleet = EmbeddedFleetState([f"127.0.0.1:{server.port}"], identity, token=token)
                await fleet.start()
                try:
                    assert len(fleet.members()) == members, token
                finally:
                    await fleet.stop()

    with caplog.at_level("ERROR", logger="gateway.fleet.embedded_fleet"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if "refuses this gateway's worker token" in r.getMessage()]
    assert len(refusals) == 2 and "missing worker token" in refusals[0] and "invalid worker token" in refusals[1]


def gateway_args(*flags: str) -> Any:
    argv = ["gateway", "--model", "sim", "--workers", "127.0.0.1:1", *flags]
    return cli.build_parser(argv).parse_args(argv)


def test_the_gateway_refuses_api_keys_without_a_salt_secret_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.cli_gateway import build_gateway

    for name in ("KVROUTE_CACHE_SALT_SECRET", "KVROUTE_CACHE_SALT_SECRET_FILE", "KVROUTE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"tenant": "acme", "key_sha256": key_sha256("sk-acme")}]))
    with pytest.raises(cli.UserError, match=r"no cache-salt secret: set \$KVROUTE_CACHE_SALT_SECRET_FILE"):
        build_gateway(gateway_args("--api-keys-file", str(keys)))
    derived = build_gateway(gateway_args("--api-keys-file", str(keys), "--allow-derived-salt"))
    assert derived.request_path.auth.authenticate("sk-acme").cache_salt == tenant_salt("acme")
    build_gateway(gateway_args())  # no keys: an open gateway needs no secret

    secret = tmp_path / "salt-secret"
    secret.write_text("s3cret-from-a-mounted-file\n")  # the newline is not part of it
    monkeypatch.setenv("KVROUTE_CACHE_SALT_SECRET_FILE", str(secret))
    salted = build_gateway(gateway_args("--api-keys-file", str(keys)))
    assert salted.request_path.auth.authenticate("sk-acme").cache_salt == tenant_salt(
        "acme", b"s3cret-from-a-mounted-file"
    )
    monkeypatch.setenv("KVROUTE_CACHE_SALT_SECRET", "another")
    with pytest.raises(cli.UserError, match="both set"):
        build_gateway(gateway_args("--api-keys-file", str(keys)))
    monkeypatch.setenv("KVROUTE_CACHE_SALT_SECRET_FILE", str(tmp_path / "missing"))
    monkeypatch.delenv("KVROUTE_CACHE_SALT_SECRET")
    with pytest.raises(cli.UserError, match=r"\$KVROUTE_CACHE_SALT_SECRET_FILE: cannot read"):
        build_gateway(gateway_args("--api-keys-file", str(keys)))
    monkeypatch.delenv("KVROUTE_CACHE_SALT_SECRET_FILE")
    short = tmp_path / "short-token"
    short.write_text("abc")
    with pytest.raises(cli.UserError, match="--worker-token-file: the worker token has 3 characters"):
        build_gateway(gateway_args("--worker-token-file", str(short)))


def fill(engine: LLMEngine, num_prompts: int) -> set[bytes]:
    """Cache distinct chains of full blocks (offline, before serving); the pool's cached set after it."""
    prompt_len = engine.max_model_len - engine.config.block_size
    prompts = [[k + 1] + [100 + i % 40000 for i in range(prompt_len - 1)] for k in range(num_prompts)]
    engine.generate(prompts, SamplingParams(max_tokens=1))
    return set(engine.kv_manager.pool.snapshot()[1])


def test_a_big_pools_snapshot_comes_in_bounded_pages_and_the_gateways_index_equals_the_pool() -> None:
    """A 20,000-block pool's snapshot in pages of at most 8,192 blocks. Requests that evict and store blocks
    between the pages change nothing of the contract: the pages' union with the events after the snapshot's seq
    is the pool's cached set. A gateway reads every page and its index equals the pool."""
    engine = sim_engine(num_kv_blocks=20_000, max_model_len=4096)
    cached = fill(engine, 80)
    assert len(cached) == 20_000

    async def churn(stub: worker_pb2_grpc.WorkerStub, first: int) -> None:
        for k in range(first, first + 8):  # 600 tokens each: 37 blocks stored, as many evicted
            async for _ in stub.Generate(generate_request([40_000 + k] * 600)):
                pass

    async def main() -> None:
        async with worker(engine, auth_token=TOKEN, kv_snapshot_burst=20) as (server, channel):
            stub = worker_stub(channel, TOKEN)
            pages = [await stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=0))]
            assert len(pages[0].snapshot_hashes) == 8192 and pages[0].next_snapshot_cursor
            while pages[-1].next_snapshot_cursor:
                await churn(stub, 10 * len(pages))
                request = worker_pb2.GetKVEventsRequest(snapshot_cursor=pages[-1].next_snapshot_cursor)
                pages.append(await stub.GetKVEvents(request))
            assert len(pages) == 3 and all(len(p.snapshot_hashes) <= 8192 for p in pages)
            assert all(p.is_snapshot and p.snapshot_seq == pages[0].snapshot_seq for p in pages)
            assert pages[-1].latest_seq > pages[0].snapshot_seq, "the cache changed between the pages"
            rebuilt = {h for p in pages for h in p.snapshot_hashes}
            after = await stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=pages[0].snapshot_seq))
            assert not after.is_snapshot and after.events[-1].seq == after.latest_seq
            for event in after.events:
                if event.kind == worker_pb2.KVEvent.KIND_STORED:
                    rebuilt |= set(event.block_hashes)
                else:
                    rebuilt -= set(event.block_hashes)
            seq, pool = await server.engine.call(lambda e: e.kv_manager.pool.snapshot())
            assert seq == after.latest_seq and rebuilt == set(pool) != cached
            bad = worker_pb2.GetKVEventsRequest(snapshot_cursor=b"\x00" * 20)
            assert await code_of(stub.GetKVEvents(bad)) == grpc.StatusCode.INVALID_ARGUMENT

            # The gateway (pages of 1,000 blocks here) while requests run, then at rest: its index is the pool.
            identity = fleet_identity(engine.model_id, engine.tokenizer)
            fleet = EmbeddedFleetState(
                [f"127.0.0.1:{server.port}"], identity, token=TOKEN, max_snapshot_blocks=1000, poll_interval=0.05
            )
            running = asyncio.ensure_future(churn(stub, 100))
            await fleet.start()
            await running
            try:
                deadline = time.monotonic() + 10
                while True:
                    seq, pool = await server.engine.call(lambda e: e.kv_manager.pool.snapshot())
                    index, member = fleet.view().kv_index, fleet.members()[0].worker_id
                    if index.last_seq(member) == seq or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                assert index.last_seq(member) == seq and fleet.counters.resyncs >= 1
                assert index.held(member) == set(pool)
            finally:
                await fleet.stop()

    asyncio.run(main())


def test_snapshot_reads_past_the_rate_limit_are_resource_exhausted_with_a_pushback() -> None:
    engine = sim_engine(num_kv_blocks=64)
    fill(engine, 4)

    async def main() -> None:
        async with worker(engine, kv_snapshot_rate=2.0, kv_snapshot_burst=2.0) as (server, channel):
            stub = worker_pb2_grpc.WorkerStub(channel)
            snapshot = worker_pb2.GetKVEventsRequest(after_seq=10**9)  # ahead of the worker: a snapshot
            replies = [await stub.GetKVEvents(snapshot) for _ in range(2)]
            assert all(reply.is_snapshot for reply in replies)
            events = await stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=replies[-1].snapshot_seq))
            assert not events.is_snapshot  # events from the log are not limited
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetKVEvents(snapshot)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 whole-pool reads per second" in (refused.value.details() or "")
            pushback = dict(refused.value.trailing_metadata() or ())["grpc-retry-pushback-ms"]
            assert 0 < int(pushback) <= 500
            await asyncio.sleep(int(pushback) / 1000)
            assert (await stub.GetKVEvents(snapshot)).is_snapshot

            # A gateway that starts while the limit is spent waits out the pushback and still gets the snapshot.
            fleet = EmbeddedFleetState(
                [f"127.0.0.1:{server.port}"], fleet_identity(engine.model_id, engine.tokenizer), poll_interval=0.05
            )
            started = time.monotonic()
            await fleet.start()
            try:
                assert time.monotonic() - started >= 0.2
                member = fleet.members()[0].worker_id
                pool = set(engine.kv_manager.pool.snapshot()[1])
                index = fleet.view().kv_index
                assert pool and index.held(member) == set(pool)
            finally:
                await fleet.stop()

    asyncio.run(main())


@pytest.mark.slow
def test_kvroute_worker_and_gateway_processes_share_their_secrets_through_files_only(
    tmp_path: Path, launcher: Fleet
) -> None:
    """`kvroute worker --auth-token-file --redis` and `kvroute gateway --worker-token-file --redis` over a
    Redis that requires a password: the gateway finds the worker through Redis and serves HTTP (cached tokens
    on a repeat) and the routed Worker.Generate; the worker's own HTTP front door serves too; a client on the
    worker port is refused; and no secret is on either command line."""
    secrets = {"token": TOKEN, "redis": generate_secret(), "salt": generate_secret()}
    for name, value in secrets.items():
        (tmp_path / name).write_text(value + "\n")
    api_key = "sk-" + generate_secret()
    (tmp_path / "keys.json").write_text(json.dumps([{"tenant": "acme", "key_sha256": key_sha256(api_key)}]))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")},
        "KVROUTE_REDIS_PASSWORD_FILE": str(tmp_path / "redis"),
        "KVROUTE_CACHE_SALT_SECRET_FILE": str(tmp_path / "salt"),
    }
    worker_port, worker_http, http_port, grpc_port = free_port(), free_port(), free_port(), free_port()
    with RedisServer(password=secrets["redis"]) as redis:
        try:
            worker_argv = kvroute_argv(
                "worker", "--model", "sim", "--port", str(worker_port), "--http-port", str(worker_http),
                "--auth-token-file", str(tmp_path / "token"), "--redis", redis.url, "--worker-id", "w0",
                "--sim-decode-ms-per-step", "1",
            )  # fmt: skip
            gateway_argv = kvroute_argv(
                "gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(http_port),
                "--grpc-port", str(grpc_port), "--redis", redis.url, "--worker-token-file", str(tmp_path / "token"),
                "--api-keys-file", str(tmp_path / "keys.json"), "--log-level", "warning",
            )  # fmt: skip
            worker_process = launcher.spawn("worker", worker_argv, env=env)
            gateway_process = launcher.spawn("gateway", gateway_argv, env=env)
            worker_process.wait_for_line("kvroute worker: serving", timeout_s=60)
            gateway_process.wait_for_line("kvroute gateway: serving", timeout_s=60)
            for process in launcher.children:
                command_line = Path(f"/proc/{process.pid}/cmdline").read_text()
                assert not any(secret in command_line for secret in secrets.values())

            base, headers = f"http://127.0.0.1:{http_port}", {"authorization": f"Bearer {api_key}"}
            deadline = time.monotonic() + 20
            while httpx.get(f"{base}/ready").status_code != 200:  # the worker registers in Redis, then is read
                assert time.monotonic() < deadline, "the gateway never saw the worker through Redis"
                time.sleep(0.1)
            body = {"model": "sim", "prompt": "the quick brown fox jumps over the lazy dog " * 20, "max_tokens": 2}
            usages = [httpx.post(f"{base}/v1/completions", json=body, headers=headers).json()["usage"] for _ in "ab"]
            assert usages[0]["prompt_tokens"] > 32 and usages[1]["prompt_tokens_details"]["cached_tokens"] >= 32
            refused = httpx.post(f"{base}/v1/completions", json=body, headers={"authorization": f"Bearer {TOKEN}"})
            assert refused.status_code == 401  # the worker token is no API key: a client cannot use it here

            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # routed with the gateway's token
                stream = worker_pb2_grpc.WorkerStub(channel).Generate(
                    generate_request([5] * 40), metadata=(("authorization", f"Bearer {api_key}"),), timeout=10
                )
                assert [r for r in stream][-1].usage.prompt_tokens == 40
                with pytest.raises(grpc.RpcError) as as_worker:  # nor as a gateway's client on its Worker service
                    list(
                        worker_pb2_grpc.WorkerStub(channel).Generate(
                            generate_request([5] * 40), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10
                        )
                    )
                assert as_worker.value.code() == UNAUTHENTICATED
            with grpc.insecure_channel(f"127.0.0.1:{worker_port}") as channel:
                with pytest.raises(grpc.RpcError) as direct:
                    worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
                assert direct.value.code() == UNAUTHENTICATED
            own = httpx.post(f"http://127.0.0.1:{worker_http}/v1/completions", json=body, timeout=10)
            assert own.status_code == 200 and own.json()["usage"]["completion_tokens"] == 2
        finally:
            launcher.stop()  # before Redis stops: a worker drains by deregistering there


def test_a_worker_refuses_to_start_with_an_unreadable_or_weak_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weak = tmp_path / "weak"
    weak.write_text("password\n")
    for path, message in ((weak, "has 8 characters, fewer than 16"), (tmp_path / "absent", "cannot read")):
        argv = ["worker", "--model", "sim", "--port", "0", "--num-kv-blocks", "16", "--auth-token-file", str(path)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "kvroute worker: error: --auth-token-file: " in err and message in err, err


def test_kvroute_up_draws_the_fleets_secrets_unless_the_environment_names_them() -> None:
    from launch.up import fleet_environment

    drawn = fleet_environment({"PATH": "/bin"})
    assert drawn["PATH"] == "/bin" and len(drawn["KVROUTE_WORKER_TOKEN"]) >= 40
    assert len(drawn["KVROUTE_CACHE_SALT_SECRET"]) >= 40
    assert drawn["KVROUTE_CACHE_SALT_SECRET"] != drawn["KVROUTE_WORKER_TOKEN"]
    assert fleet_environment({})["KVROUTE_WORKER_TOKEN"] != drawn["KVROUTE_WORKER_TOKEN"]
    named = {"KVROUTE_WORKER_TOKEN_FILE": "/run/token", "KVROUTE_CACHE_SALT_SECRET": "shared"}
    assert fleet_environment(named) == named  # several `up`s sharing a Redis share these
