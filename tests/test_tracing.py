"""Traces as a real OpenTelemetry backend stores them (issue 19, item 12): `kvroute up` (a gateway and a worker
process) exports over OTLP/gRPC to a real Phoenix server, and one request makes one trace: the gateway's span,
the worker's span as its child, and the worker's queue, prefill and decode spans under that, with the GenAI
semantic-convention attributes and the engine's step counts.

Phoenix (the `arize-phoenix` package) is installed by .ci/run into its own virtual environment,
/opt/phoenix-venv (or $KVROUTE_PHOENIX_VENV); where it is absent the test is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launch.fleet import Fleet, free_port, http_ok

PHOENIX = Path(os.environ.get("KVROUTE_PHOENIX_VENV", "/opt/phoenix-venv")) / "bin" / "phoenix"
MAX_TOKENS = 4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PHOENIX.exists(), reason=f"no Phoenix OTLP receiver at {PHOENIX} (.ci/run installs it)"),
]


@dataclass
class Phoenix:
    http_url: str
    grpc_endpoint: str

    def spans(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.http_url}/v1/projects/default/spans?limit=100", timeout=5) as response:
            return json.loads(response.read())["data"]


@pytest.fixture()
def phoenix(tmp_path: Path, launcher: Fleet) -> Phoenix:
    """Phoenix, started and not yet waited for (~15 s to serve): the test starts its fleet meanwhile."""
    http_port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(tmp_path / "phoenix"),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http_port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
    }
    launcher.spawn("phoenix", [str(PHOENIX), "serve"], env=env)
    return Phoenix(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{grpc_port}")


def test_a_request_is_one_trace_gateway_then_worker_then_its_phases(
    phoenix: Phoenix, launcher: Fleet, launcher_up
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export at once rather than every 5 s
    }
    up = launcher_up(
        "--workers", "1", "--model", "sim", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0",
        "--worker-args", "--num-kv-blocks 64 --max-model-len 512", env=env, timeout_s=120,
    )  # fmt: skip
    # The exporters connect when they first send, after the request: Phoenix need serve only by then.
    launcher.wait_until(lambda: http_ok(f"{phoenix.http_url}/v1/projects/default/spans?limit=1"), "Phoenix", 90)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": MAX_TOKENS}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == MAX_TOKENS
    deadline = time.monotonic() + 30
    spans = phoenix.spans()
    while len(spans) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
        spans = phoenix.spans()
    up.signal(signal.SIGINT, wait_s=60)

    by_name = {span["name"]: span for span in spans}
    assert sorted(by_name) == sorted(
        ["kvroute.gateway.generate", "kvroute.worker.generate", "kvroute.worker.queue", "kvroute.worker.prefill",
         "kvroute.worker.decode"]
    ), sorted(by_name)  # fmt: skip
    assert len({span["context"]["trace_id"] for span in spans}) == 1, "one trace"
    gateway, worker = by_name["kvroute.gateway.generate"], by_name["kvroute.worker.generate"]
    assert gateway["parent_id"] is None
    assert worker["parent_id"] == gateway["context"]["span_id"]
    phases = [by_name[f"kvroute.worker.{phase}"] for phase in ("queue", "prefill", "decode")]
    assert all(phase["parent_id"] == worker["context"]["span_id"] for phase in phases)
    assert [p["start_time"] for p in phases] == sorted(p["start_time"] for p in phases)
    assert phases[1]["attributes"]["kvroute.steps"] >= 1
    assert phases[2]["attributes"]["kvroute.steps"] == MAX_TOKENS - 1  # the first token comes with the prefill

    for span, operation in ((gateway, "chat"), (worker, "text_completion")):
        attributes = span["attributes"]
        assert attributes["gen_ai.operation.name"] == operation
        assert attributes["gen_ai.provider.name"] == "kvroute"
        assert attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
        assert attributes["gen_ai.request.temperature"] == 1.0
        assert attributes["gen_ai.usage.input_tokens"] > 0
        assert attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert gateway["attributes"]["gen_ai.request.model"] == "sim"
    assert worker["attributes"]["gen_ai.request.model"] == "sim-v1"  # the worker's model id
    assert gateway["attributes"]["gen_ai.usage.input_tokens"] == worker["attributes"]["gen_ai.usage.input_tokens"]
