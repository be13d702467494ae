"""KV events from the engines' own code: SGLang's `sglang.srt.disaggregation.kv_events` (the sglang wheel,
installed `--no-deps` by .ci/run) and vLLM's `vllm/distributed/kv_events.py` (from the vllm wheel, loaded by
path with stubs for its unrelated imports; see tests/engine_kv_events_producer.py) publish batches with their
own structs and ZmqEventPublisher, replay included, and the gateway's subscriber must index exactly the blocks
kvroute's own hash gives those tokens; and their typed decoders must read what kvroute's encoder writes.
Older releases' positional events are encoded here with msgspec structs written from vLLM's field order."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.fleet.engine_events import EngineEventSource, EngineEventSubscriber
from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from kvroute.engine_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
)
from kvroute.hashing import block_hashes, hash_fingerprint
from tests.test_engine_events import caught_up, generate, start_worker, stop_worker

ROOT = Path(__file__).resolve().parents[1]
PRODUCER = ROOT / "tests" / "engine_kv_events_producer.py"
WHEELS = Path(os.environ.get("KVROUTE_ENGINE_WHEELS", "/opt/engine-wheels"))
SGLANG_PATH = [WHEELS / "sglang", WHEELS / "sglang-deps"]
VLLM_SOURCES = WHEELS / "vllm-0.33.0"
BLOCK = 4
MODEL = "m"


def engine_env(engine: str) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "sglang":
        if not (SGLANG_PATH[0] / "sglang" / "srt" / "disaggregation" / "kv_events.py").exists():
            pytest.skip(f"the sglang wheel is not installed under {SGLANG_PATH[0]} (.ci/run installs it)")
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in SGLANG_PATH] + [str(ROOT)])
    else:
        if not (VLLM_SOURCES / "vllm" / "distributed" / "kv_events.py").exists():
            pytest.skip(f"vLLM's kv_events.py is not under {VLLM_SOURCES} (.ci/run extracts it from the wheel)")
        env["KVROUTE_VLLM_SOURCES"] = str(VLLM_SOURCES)
    return env


def book() -> FleetBook:
    identity = FleetIdentity(MODEL, BLOCK, hash_fingerprint(MODEL, BLOCK), "tok")
    fleet = FleetBook(identity)
    fleet.admit("w", "127.0.0.1:1", 1, MODEL, BLOCK, 256, identity.hash_fingerprint, "tok")
    return fleet


def holds_exactly(fleet: FleetBook, hashes: set[bytes]) -> bool:
    index = fleet.fleet.kv_index
    return index.held("w") == hashes and all(index.match([h]) == [1] for h in hashes)  # and not stale


A, B, C = list(range(10, 22)), list(range(50, 58)), list(range(90, 98))


def pages(tokens: list[int], first_hash: int, salt: str | None = None) -> list[dict[str, Any]]:
    """SGLang's events for a prompt with page size 1: one BlockStored per page, chained."""
    return [
        {
            "type": "BlockStored",
            "block_hashes": [first_hash - i],
            "token_ids": [t],
            "block_size": 1,
            "parent_block_hash": None if i == 0 else first_hash - i + 1,
            "cache_salt": salt if i == 0 else None,
        }  # fmt: skip
        for i, t in enumerate(tokens)
    ]


SGLANG_SPEC = {
    "early": 2,
    "batches": [
        pages(A, -1000),  # signed 64-bit hashes, as SGLang's namespaced ones are
        pages(B, -2000, salt="tenant-b"),
        [{"type": "BlockRemoved", "block_hashes": [-1000 - 11]}],  # A's last page: A's third block goes
        pages(C, 3000),
    ],
}
VLLM_SPEC = {
    "early": 2,
    "batches": [
        [{"type": "BlockStored", "block_hashes": [11, 12, 13], "token_ids": A, "block_size": BLOCK}],
        [
            {
                "type": "BlockStored",
                "block_hashes": [21, 22],
                "token_ids": B,
                "block_size": BLOCK,
                "extra_keys": [["tenant-b"], None],  # where vLLM puts a request's cache_salt
            }  # fmt: skip
        ],
        [{"type": "BlockRemoved", "block_hashes": [13]}],
        [{"type": "BlockStored", "block_hashes": [31, 32], "token_ids": C, "block_size": BLOCK}],
    ],
}


def expected_blocks() -> set[bytes]:
    return {
        *block_hashes(A, model_id=MODEL, block_size=BLOCK)[:2],
        *block_hashes(B, model_id=MODEL, cache_salt="tenant-b", block_size=BLOCK),
        *block_hashes(C, model_id=MODEL, block_size=BLOCK),
    }


@pytest.mark.parametrize("engine,spec", [("sglang", SGLANG_SPEC), ("vllm", VLLM_SPEC)])
def test_the_engines_own_publisher_is_indexed_with_kvroutes_hash(engine: str, spec: dict, tmp_path: Path) -> None:
    env = engine_env(engine)
    endpoint, replay, topic = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", "kv@127.0.0.1:8000@m"
    producer = subprocess.Popen(
        [sys.executable, str(PRODUCER), engine, "publish", endpoint, replay, topic, json.dumps(spec)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = producer.stdout.readline()
        assert line.strip() == "ready", producer.stderr.read()

        async def main() -> EngineEventSubscriber:
            fleet = book()
            subscriber = EngineEventSubscriber(fleet, EngineEventSource("w", endpoint, replay, topic=topic))
            await subscriber.start()
            try:
                await asyncio.sleep(0.3)  # connected before the rest is published
                producer.stdin.write("go\n")
                producer.stdin.flush()
                deadline = time.monotonic() + 10
                while not holds_exactly(fleet, expected_blocks()):
                    assert time.monotonic() < deadline, f"index never matched: {subscriber.counters}"
                    await asyncio.sleep(0.02)
            finally:
                await subscriber.stop()
            return subscriber

        subscriber = asyncio.run(main())
        # The two batches published before it connected came from the engine's own replay socket.
        assert subscriber.counters.replayed_batches >= 2 and subscriber.counters.dropped == {}
    finally:
        producer.stdin.close()
        try:
            producer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engines_own_decoder_reads_kvroutes_encoder(engine: str) -> None:
    env = engine_env(engine)
    batches = [
        EventBatch(
            1.5,
            (
                BlockStored((1, 2), None, tuple(range(8)), BLOCK, None, "GPU", None, (("tenant-b",), None)),
                BlockStored((2**64 - 1,), 2, tuple(range(8, 12)), BLOCK, None, "GPU"),
            ),
        ),
        EventBatch(2.5, (BlockRemoved((2**64 - 1,), "GPU"), AllBlocksCleared())),
    ]
    stdin = "".join(encode_batch(b).hex() + "\n" for b in batches)
    result = subprocess.run(
        [sys.executable, str(PRODUCER), engine, "decode"], input=stdin, cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    decoded = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["ts"] for d in decoded] == [1.5, 2.5]
    first, second = decoded[0]["events"]
    assert first["type"] == "BlockStored" and first["block_hashes"] == [1, 2] and first["parent_block_hash"] is None
    assert first["token_ids"] == list(range(8)) and first["block_size"] == BLOCK and first["medium"] == "GPU"
    if engine == "vllm":
        assert first["extra_keys"] == [["tenant-b"], None]
    assert second["block_hashes"] == [2**64 - 1] and second["parent_block_hash"] == 2
    assert [e["type"] for e in decoded[1]["events"]] == ["BlockRemoved", "AllBlocksCleared"]
    assert decoded[1]["events"][0]["block_hashes"] == [2**64 - 1]


# -- older releases: positional events, the tag first -----------------------------------------------------------


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _OldBlockStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _OldBlockRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _OldAllBlocksCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_OldBlockStored | _OldBlockRemoved | _OldAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_positional_events_of_older_releases_decode_and_index() -> None:
    old = _OldBatch(
        1.0,
        [
            _OldBlockStored([b"\x01" * 32, b"\x02" * 32, b"\x03" * 32], None, A, BLOCK, None, "GPU"),
            _OldBlockRemoved([b"\x03" * 32]),
            _OldBlockStored([7], None, A[:4], BLOCK, None),  # without the optional medium
            _OldAllBlocksCleared(),
            _OldBlockStored([8, 9], None, B, BLOCK, None),
        ],
        0,
    )
    payload = msgspec.msgpack.encode(old)
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared", "BlockStored",
    ]  # fmt: skip
    assert batch.events[0].block_hashes[0] == b"\x01" * 32 and batch.data_parallel_rank == 0
    fleet = book()
    subscriber = EngineEventSubscriber(fleet, EngineEventSource("w", None))
    subscriber.handle([b"", encode_seq(0), payload])
    assert holds_exactly(fleet, set(block_hashes(B, model_id=MODEL, block_size=BLOCK)))
    assert subscriber.counters.cleared == 1


def test_the_workers_batches_decode_as_vllms_three_field_event_batch() -> None:
    """vLLM's publisher stamps every batch with its data-parallel rank, and consumers that decode a fixed
    three-field tuple (Dynamo's router) refuse `[ts, events]`: the worker sends the rank too."""
    env = engine_env("vllm")

    async def first_payload() -> bytes:
        server, publisher = await start_worker()
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(publisher.endpoint)
            await asyncio.sleep(0.3)  # subscribed before the first batch goes out
            await generate(server, list(range(100, 120)))
            await caught_up(server, publisher)
            async with asyncio.timeout(10):
                _topic, _seq, payload = await sub.recv_multipart()
            return payload
        finally:
            sub.close(linger=0)
            await stop_worker(server, publisher)

    payload = asyncio.run(first_payload())
    assert len(msgspec.msgpack.decode(payload)) == 3
    result = subprocess.run(
        [sys.executable, str(PRODUCER), "vllm", "decode"], input=payload.hex() + "\n", cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (decoded,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert decoded["data_parallel_rank"] == 0
    assert decoded["events"][0]["type"] == "BlockStored" and decoded["events"][0]["token_ids"][:16] == list(
        range(100, 116)
    )
