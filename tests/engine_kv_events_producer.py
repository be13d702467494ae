"""The engines' own KV-event code, run in a subprocess of its own (tests/test_engine_kv_events_reference.py):

    python tests/engine_kv_events_producer.py ENGINE publish ENDPOINT REPLAY TOPIC SPEC_JSON
    python tests/engine_kv_events_producer.py ENGINE decode            (hex payloads on stdin, one a line)

ENGINE `sglang`: `sglang.srt.disaggregation.kv_events` imported from a `--no-deps` install of the sglang wheel
(its directory and that of its few light imports on PYTHONPATH). ENGINE `vllm`: `vllm/distributed/kv_events.py`
and `vllm/config/kv_events.py` of the vllm wheel, loaded by path from $KVROUTE_VLLM_SOURCES, with stubs only for
the imports that are not about KV events (the logger, network helpers, the config decorator, a type alias): the
package does not import from a `--no-deps` install (its import chain wants many of vLLM's dependencies).

`publish`: the engine's own ZmqEventPublisher publishes the batches of SPEC (a list of batches, each a list of
events `{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...fields}`) built with the engine's own
structs: the first `SPEC["early"]` batches at once, then "ready" on stdout; the rest after a line on stdin; then
it serves replays until stdin closes. `decode`: each payload decoded with the engine's own typed decoder
(`KVEventBatch`), printed back as JSON.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import sys
import time
import types


def load_vllm() -> types.ModuleType:
    root = os.environ["KVROUTE_VLLM_SOURCES"]

    def stub(name: str, **attrs: object) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module

    for package in ("vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        stub(package, __path__=[])
    stub("vllm.config.utils", config=dataclasses.dataclass)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda path: path.rsplit(":", 2),
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)

    def load(name: str, relative: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, relative))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    load("vllm.config.kv_events", "vllm/config/kv_events.py")
    return load("vllm.distributed.kv_events", "vllm/distributed/kv_events.py")


def load(engine: str) -> types.ModuleType:
    if engine == "sglang":
        import sglang.srt.disaggregation.kv_events as module

        return module
    return load_vllm()


def build(kv: types.ModuleType, engine: str, event: dict) -> object:
    kind = event.pop("type")
    if kind == "AllBlocksCleared":
        return kv.AllBlocksCleared()
    if kind == "BlockRemoved":
        return kv.BlockRemoved(block_hashes=event["block_hashes"], medium=event.get("medium"))
    fields = {
        "block_hashes": event["block_hashes"],
        "parent_block_hash": event.get("parent_block_hash"),
        "token_ids": event["token_ids"],
        "block_size": event["block_size"],
        "lora_id": None,
        "medium": event.get("medium", "GPU"),
    }
    if engine == "sglang":
        fields["cache_salt"] = event.get("cache_salt")
    else:
        fields["lora_name"] = None
        fields["extra_keys"] = event.get("extra_keys")
    return kv.BlockStored(**fields)


def publish(kv: types.ModuleType, engine: str, endpoint: str, replay: str, topic: str, spec: dict) -> None:
    rank = {"attn_dp_rank": 0} if engine == "sglang" else {"data_parallel_rank": 0}
    publisher = kv.ZmqEventPublisher(endpoint=endpoint, replay_endpoint=replay, topic=topic, **rank)
    batches = [kv.KVEventBatch(ts=time.time(), events=[build(kv, engine, dict(e)) for e in b]) for b in spec["batches"]]
    for batch in batches[: spec["early"]]:
        publisher.publish(batch)
    time.sleep(0.3)  # the publisher thread has sent them
    print("ready", flush=True)
    sys.stdin.readline()
    for batch in batches[spec["early"] :]:
        publisher.publish(batch)
    print("published", flush=True)
    sys.stdin.read()  # serve replays until the test closes stdin
    publisher.shutdown()


def decode(kv: types.ModuleType) -> None:
    import msgspec

    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    for line in sys.stdin:
        batch = decoder.decode(bytes.fromhex(line.strip()))
        out = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
        rank = batch.attn_dp_rank if hasattr(batch, "attn_dp_rank") else batch.data_parallel_rank  # SGLang's name
        print(json.dumps({"ts": batch.ts, "events": out, "data_parallel_rank": rank}), flush=True)


def main() -> None:
    engine, mode = sys.argv[1], sys.argv[2]
    kv = load(engine)
    if mode == "publish":
        publish(kv, engine, sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))
    else:
        decode(kv)


if __name__ == "__main__":
    main()
