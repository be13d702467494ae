"""benchmarks/epp_bench.py's in-process part: the picker's decision time over a live sim worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.epp_bench import MODEL_LEN, decision_time
from launch.fleet import Fleet, free_port, grpc_serving, kvroute_argv


def test_the_decision_time_runs_over_the_pickers_one_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The picker of `kvroute epp --model sim` holds its request path as its one pool; the bench reads it there."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with Fleet(tmp_path) as fleet:
        fleet.spawn(
            "worker",
            kvroute_argv(
                "worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                "--max-model-len", str(MODEL_LEN), "--sim-prefill-us-per-token", "0", "--sim-decode-ms-per-step", "0",
            ),
        )  # fmt: skip
        fleet.wait_until(lambda: grpc_serving(address), "the sim worker", 120)
        decision_time([address], [f"127.0.0.1:{free_port()}"])
    assert "decision for a" in capsys.readouterr().out
