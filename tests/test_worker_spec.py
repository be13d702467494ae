"""Worker specs (gateway.worker_spec): the grammar `--workers` and the routing config take, and its refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.cli_gateway import build_gateway
from gateway.fleet.engine_fleet import EngineFleetState
from gateway.worker_spec import WorkerSpec, parse_worker_spec, parse_worker_specs
from kvroute.errors import UserError
from launch.cli import build_parser


def test_bare_and_kvroute_specs_are_grpc_workers() -> None:
    assert parse_worker_spec("10.0.0.1:50051") == WorkerSpec("kvroute", "10.0.0.1", 50051)
    assert parse_worker_spec("kvroute://w-0.svc:50051") == WorkerSpec("kvroute", "w-0.svc", 50051)
    assert parse_worker_spec("[::1]:50051").address == "[::1]:50051"


def test_engine_specs_carry_their_event_endpoints() -> None:
    spec = parse_worker_spec("vllm://10.0.0.5:8000?events=tcp://10.0.0.5:5557&replay=tcp://10.0.0.5:5558&topic=kv")
    assert (spec.engine, spec.host, spec.port) == ("vllm", "10.0.0.5", 8000)
    assert (spec.events, spec.replay, spec.topic) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")
    assert spec.metrics == "http://10.0.0.5:8000/metrics"
    assert spec.base_url == "http://10.0.0.5:8000"
    sglang = parse_worker_spec("sglang://h:30000?metrics=http://h:9000/metrics")
    assert (sglang.engine, sglang.events, sglang.metrics) == ("sglang", None, "http://h:9000/metrics")


def test_dns_spec_fills_each_address_into_its_endpoints() -> None:
    spec = parse_worker_spec("vllm://vllm.ns.svc:8000?events=tcp://*:5557&replay=tcp://*:5558&discover=dns")
    assert spec.discover == "dns"
    one = spec.at("10.1.2.3")
    assert (one.host, one.discover) == ("10.1.2.3", None)
    assert (one.events, one.replay, one.metrics) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558",
                                                     "http://10.1.2.3:8000/metrics")  # fmt: skip
    assert spec.at("fd00::7").events == "tcp://[fd00::7]:5557"


def test_a_data_parallel_engine_is_one_target_per_rank_on_its_ports_plus_rank() -> None:
    spec = parse_worker_spec("sglang://10.0.0.5:30000?events=tcp://10.0.0.5:5557&replay=tcp://10.0.0.5:5600&dp=3")
    ranks = spec.ranks()
    assert [r.worker_id for r in ranks] == [f"10.0.0.5:30000/dp{r}" for r in range(3)]
    assert {r.address for r in ranks} == {"10.0.0.5:30000"}
    assert [(r.events, r.replay) for r in ranks] == [
        (f"tcp://10.0.0.5:{5557 + r}", f"tcp://10.0.0.5:{5600 + r}") for r in range(3)
    ]
    plain = parse_worker_spec("vllm://10.0.0.5:8000")
    assert plain.ranks() == [plain] and plain.worker_id == "10.0.0.5:8000"


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("tgi://h:80", "unknown engine 'tgi'"),
        ("vllm://h:0", "port must be in [1, 65535]"),
        ("vllm://h:http", "port must be in"),
        ("vllm://h", "expected host:port"),
        ("h:99999", "port must be in"),
        ("vllm://h:8000?event=tcp://h:1", "unknown query key 'event'"),
        ("vllm://h:8000?events=tcp://h:1&events=tcp://h:2", "given twice"),
        ("kvroute://h:50051?events=tcp://h:1", "takes no query"),
        ("vllm://h:8000?events=ipc:///tmp/x", "must be a tcp:// endpoint"),
        ("vllm://h:8000?events=tcp://*:5557", "only with discover=dns"),
        ("vllm://h:8000?replay=tcp://h:5558", "replay needs events"),
        ("vllm://h:8000?discover=srv", "discover must be 'dns'"),
        ("vllm://h:8000/v1", "only host:port and a query"),
        ("vllm://fd00::1:8000", "IPv6 host in brackets"),
        ("vllm://h:8000?metrics=ftp://x", "http(s) URL"),
        ("vllm://h:8000?dp=0", "dp must be an integer in [1, 256]"),
        ("vllm://h:8000?dp=two", "dp must be an integer"),
        ("vllm://h:8000?events=tcp://h:65535&dp=2", "rank 1's events port"),
        ("vllm://h:8000?events=tcp://h:5557&replay=tcp://h:5558&dp=2", "must be at least 2 apart"),
        ("vllm://h:8000?id=", "id must be 1 to 128 letters"),
        ("vllm://h:8000?id=pod%20a", "id must be 1 to 128 letters"),
        ("vllm://h:8000?id=a/dp0", "id must be 1 to 128 letters"),
        ("vllm://h:8000?id=" + "x" * 129, "id must be 1 to 128"),
        ("vllm://h.svc:8000?id=a&discover=dns", "id names one engine"),
        ("kvroute://h:50051?id=w0", "takes no query"),
    ],
)
def test_bad_specs_are_refused_naming_the_fault(text: str, fault: str) -> None:
    with pytest.raises(ValueError, match="worker") as raised:
        parse_worker_spec(text)
    assert fault in str(raised.value)


def test_an_engine_named_by_id_is_that_worker_and_its_ranks_are_under_it() -> None:
    spec = parse_worker_spec("vllm://10.0.0.5:8000?id=vllm-0.vllm&dp=2")
    assert spec.worker_id == "vllm-0.vllm" and spec.address == "10.0.0.5:8000"
    assert [r.worker_id for r in spec.ranks()] == ["vllm-0.vllm/dp0", "vllm-0.vllm/dp1"]
    assert len(parse_worker_specs("vllm://a:1?id=x,vllm://b:1?id=y,sglang://c:1")) == 3
    for text, fault in (
        ("vllm://a:1?id=x,sglang://b:1?id=x", "worker id 'x' is taken twice"),
        ("vllm://a:1,vllm://b:1?id=a:1", "worker id 'a:1' is taken twice"),
        ("vllm://a:1?id=x&dp=2,vllm://b:1?id=x/dp1", "id must be"),
    ):
        with pytest.raises(ValueError, match=re.escape(fault)):
            parse_worker_specs(text)


def test_two_pools_cannot_name_two_engines_alike(tmp_path: Path) -> None:
    config = tmp_path / "routing.json"
    config.write_text(json.dumps({"pools": [
        {"model": "sim", "workers": ["vllm://127.0.0.1:8000?id=pod-a"]},
        {"model": "sim", "served_model_name": "other", "workers": ["vllm://127.0.0.1:8001?id=pod-a"]},
    ]}))  # fmt: skip
    with pytest.raises(UserError, match="worker id 'pod-a' is taken twice"):
        gateway("--routing-config", str(config))


def test_a_list_refuses_a_worker_named_twice() -> None:
    assert len(parse_worker_specs("a:1, vllm://a:1 ,,b:2")) == 3
    with pytest.raises(ValueError, match="named twice"):
        parse_worker_specs("a:1,kvroute://a:1")


def gateway(*flags: str) -> Any:
    argv = ["gateway", "--model", "sim", *flags]
    return build_gateway(build_parser(argv).parse_args(argv))


def test_kvroute_gateway_takes_engine_specs_in_workers_and_the_routing_config(tmp_path: Path) -> None:
    assert type(gateway("--workers", "127.0.0.1:1").fleets[0]).__name__ == "EmbeddedFleetState"
    config = tmp_path / "routing.json"
    config.write_text(json.dumps({"epsilon": 0.25, "workers": ["sglang://127.0.0.1:30000?events=tcp://127.0.0.1:2"]}))
    built = gateway("--workers", "vllm://127.0.0.1:8000?events=tcp://127.0.0.1:1,127.0.0.1:2", "--routing-config",
                    str(config))  # fmt: skip
    (fleet,) = built.fleets
    assert isinstance(fleet, EngineFleetState)
    assert [p.spec.engine for p in fleet.engine_pollers] == ["vllm", "sglang"]
    assert [p.address for p in fleet.grpc_pollers] == ["127.0.0.1:2"]
    assert built.request_path.pool(None).policy.options.epsilon == 0.25


def test_engine_keys_and_medium_weights_come_from_the_spec_and_the_routing_config(tmp_path: Path) -> None:
    key_file = tmp_path / "vllm.key"
    key_file.write_text("sk-secret-123\n")
    config = tmp_path / "routing.json"
    config.write_text(json.dumps({"medium_weights": {"CPU": 0.5, "DISK": 0.2}, "epsilon": 0.25}))
    built = gateway("--workers", f"vllm://127.0.0.1:8000?api_key_file={key_file},sglang://127.0.0.1:8001",
                    "--routing-config", str(config))  # fmt: skip
    assert built.fleets[0].options.medium_weights == {"CPU": 0.5, "DISK": 0.2}
    default = gateway("--workers", "vllm://127.0.0.1:8000")
    assert default.fleets[0].options.medium_weights == {"CPU": 0.92}  # seed 004's copy against recompute
    config.write_text(json.dumps({"medium_weights": {}}))
    assert (
        gateway("--workers", "vllm://127.0.0.1:8000", "--routing-config", str(config)).fleets[0].options.medium_weights
        == {}
    )
    assert built.fleets[0].engine_target("127.0.0.1:8000").api_key == "sk-secret-123"
    assert built.fleets[0].engine_target("127.0.0.1:8001").api_key is None
    assert "sk-secret" not in repr(built.fleets[0].engine_target("127.0.0.1:8000"))
    assert "sk-secret" not in repr(parse_worker_spec(f"vllm://h:1?api_key_file={key_file}"))
    for weights, fault in (({"CPU": 2}, "CPU's weight must be a number in [0, 1]"), ([0.5], "must be an object")):
        config.write_text(json.dumps({"medium_weights": weights}))
        with pytest.raises(UserError, match=re.escape(fault)):
            gateway("--workers", "vllm://127.0.0.1:8000", "--routing-config", str(config))
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    for path, fault in ((tmp_path / "missing.key", "No such file"), (empty, "must hold one key")):
        with pytest.raises(UserError, match=re.escape(fault)) as refused:
            gateway("--workers", f"vllm://127.0.0.1:8000?api_key_file={path}")
        assert str(path) in str(refused.value)


@pytest.mark.parametrize(
    ("flags", "fault"),
    [
        (("--workers", "vllm://h:8000?evnts=tcp://h:1"), "unknown query key 'evnts'"),
        (("--workers", "vllm://h:8000", "--redis", "redis://127.0.0.1:1"), "--redis takes kvroute workers only"),
        ((), "name the fleet"),
        (("--workers", "vllm://h:8000?api_key_file="), "api_key_file names no file"),
        (("--workers", "kvroute://h:8000?api_key_file=/k"), "takes the gateway's --worker-token-file"),
    ],
)
def test_kvroute_gateway_refuses_a_bad_fleet_in_one_line(flags: tuple[str, ...], fault: str) -> None:
    with pytest.raises(UserError, match=re.escape(fault)):
        gateway(*flags)
