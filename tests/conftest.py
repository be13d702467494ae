"""Shared pytest fixtures. Each helper owns the fixtures under its prefix (model_, tokenizer_, ...)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvroute.model_source import ModelSource, resolve_model
from kvroute.tokenizer import Tokenizer
from launch.fleet import Child, Fleet, kvroute_argv

UP_READY_LINE = "Ctrl-C stops them all"  # what `kvroute up` prints once its fleet serves

# The test files that take longest, longest first (their summed test times in a 2-worker run, --junitxml): under
# `make test` (xdist, a file to a worker, --no-loadscope-reorder) a worker takes the next file as it frees, so
# starting the long ones first keeps one of them from being the last to start (xdist's own order, by test count,
# started the 3 tests and 2 minutes of test_cpu_classes last). The rest follow in collection order.
LONGEST_FILES_FIRST = (
    "test_engine_reference.py",
    "test_epp_envoy.py",
    "test_replay.py",
    "test_bench.py",
    "test_engine_fleet.py",
    "test_stream_faults.py",
    "test_model_reference.py",
    "test_engine_cli_parsers.py",
    "test_worker_service.py",
    "test_engine_events_abuse.py",
    "test_last_layer_rows.py",
    "test_cpu_classes.py",
    "test_helm.py",
    "test_launch.py",
    "test_tracing.py",
    "test_prompt_hardening.py",
    "test_flow_control_hostile.py",
    "test_flow_control_gateway.py",
    "test_sim_flow_control.py",
    "test_engine_kv_events_reference.py",
    "test_epp_envoy_fleets.py",
    "test_epp_replicas.py",
    "test_install.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def model_smollm2_source() -> ModelSource:
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def tokenizer_smollm2(model_smollm2_source: ModelSource) -> Tokenizer:
    return Tokenizer.from_gguf(model_smollm2_source.path)


@pytest.fixture(scope="session")
def model_smollm2_reference(model_smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """HF transformers' own SmolLM2 from the same GGUF, float32, in eval mode: the outside reference of
    tests/test_model_reference.py and tests/test_engine_reference.py. Read-only. Its GGUF load (transformers
    dequantizing: ~20 s of CPU) runs once a run: under xdist the first worker process to need it saves what it
    loaded beside the workers' temp folders (xdist's recipe: a file lock) and the others load that (~2 s)."""
    import torch
    import transformers
    from filelock import FileLock

    path = model_smollm2_source.path
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nobody to share with
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model.eval()
    saved = tmp_path_factory.getbasetemp().parent / "smollm2-reference"  # the run's, shared by its workers
    with FileLock(f"{saved}.lock"):
        if saved.is_dir():
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(saved), dtype=torch.float32
            )
            model.load_state_dict(torch.load(saved / "weights.pt", mmap=True))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            partial = saved.with_name(saved.name + ".partial")  # renamed when whole: a killed worker leaves no half
            model.config.save_pretrained(partial)
            torch.save(model.state_dict(), partial / "weights.pt")
            partial.rename(saved)
    return model.eval()


@pytest.fixture
def redis_server():
    """A real redis-server on a free port (launch/redis_server.py); `.stop()`, `.start()`, `.restart()`, `.url`."""
    from launch.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Fleet]:
    """The fleet launcher (launch/fleet.py) for the test's processes: `spawn(name, argv)` logs each child to
    `tmp_path/logs/NAME.log`; at the end of the test every child still running gets SIGTERM, then SIGKILL."""
    with Fleet(tmp_path / "logs") as fleet:
        yield fleet


@pytest.fixture(scope="module")
def launcher_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """`launcher` for a module-scoped fixture's processes, stopped after the test module."""
    with Fleet(tmp_path_factory.mktemp("logs")) as fleet:
        yield fleet


@pytest.fixture
def launcher_up(launcher: Fleet) -> Callable[..., Child]:
    """`launcher_up(*ARGS, env=None, timeout_s=240)`: `kvroute up ARGS` started by `launcher`, returned once it
    prints that its fleet serves (its workers and gateway write to its log too); LaunchError if it exits first."""

    def start(*args: str, env: Mapping[str, str] | None = None, timeout_s: float = 240.0) -> Child:
        up = launcher.spawn("up", kvroute_argv("up", *args), env=env)
        up.wait_for_line(UP_READY_LINE, timeout_s)
        return up

    return start
