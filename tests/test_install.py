"""The package as a user installs and first starts it (issue 28, item 5): `pip install .` brings the gateway's
dependencies only (no torch), the engine comes with the `worker` extra; a gateway whose OTLP exporter does not
import serves on with a warning instead of dying at start; a kernel load that waits on a compile says so."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import threading
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from launch.cli import WORKER_EXTRA_MODULES
from launch.fleet import Fleet, free_port, kvroute_argv
from tests.only_distributions import only_distributions

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT_TOML = tomllib.loads((ROOT / "pyproject.toml").read_text())
PYPROJECT = PYPROJECT_TOML["project"]
WORKER_ONLY = {"torch", "triton", "safetensors", "matplotlib", "ninja"}  # tqdm comes with gguf too

# Every installed module whose distribution `pip install .` does not bring fails to import, as on a gateway host.
OURS = {name.rstrip("*") for name in PYPROJECT_TOML["tool"]["setuptools"]["packages"]["find"]["include"]}
BASE_INSTALL_ONLY = (
    only_distributions(OURS, "`pip install .` brings no")
    + r"""
from launch.cli import build_parser
for command in ("gateway", "epp", "export-tokenizer"):
    build_parser([command])
import gateway.cli_gateway, gateway.cli_epp
# Every HTTP door's modules: our own HTTP server, no uvicorn or Starlette (not base dependencies).
import gateway.frontdoors.http_server, gateway.frontdoors.metrics_port, gateway.frontdoors.render_endpoints
assert "torch" not in sys.modules and "triton" not in sys.modules
"""
)


def test_no_other_distribution_installs_a_package_of_ours_name():
    """Our top-level packages are plain names (gateway, worker, ...): a dependency that brings a module of the same
    name would be shadowed by ours or shadow it, whichever comes first on sys.path (transformers 5.25 began
    requiring HF's `kernels`, which our kernel package was called until then)."""
    providers = metadata.packages_distributions()
    clashes = {name: sorted(set(providers[name]) - {"kvroute"}) for name in OURS if name in providers}
    assert not {name: others for name, others in clashes.items() if others}


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(requirements: list[str]) -> set[str]:
    """The distributions installing `requirements` brings (no extras), from the installed metadata."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = normalise(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(requirement.name) or []]
    return seen


def test_the_base_install_brings_no_torch_and_the_worker_extra_does() -> None:
    base = closure(PYPROJECT["dependencies"])
    assert not base & WORKER_ONLY, base & WORKER_ONLY
    worker = {normalise(Requirement(r).name) for r in PYPROJECT["optional-dependencies"]["worker"]}
    assert WORKER_ONLY <= worker == WORKER_EXTRA_MODULES  # the modules the command line names when one is missing


def test_the_worker_image_installs_the_worker_extra() -> None:
    """The images: the worker's installs the package with the engine's extra (its torch comes first, from the
    index its variant names), the gateway's without (tests/test_helm.py: its requirements are the base ones)."""
    worker = (ROOT / "deploy" / "docker" / "worker.Dockerfile").read_text()
    installs = re.findall(r"pip install (\S*/src\S*)", worker)
    assert installs and set(installs) == {"'/src[worker]'"}, installs


def test_gateway_entry_points_load_from_the_base_install_alone() -> None:
    """`kvroute gateway`, `kvroute epp` and `export-tokenizer` load with only the base dependencies importable
    (torch, triton and every other distribution of the extras blocked)."""
    allowed = sorted(closure(PYPROJECT["dependencies"]))
    result = subprocess.run(
        [sys.executable, "-c", BASE_INSTALL_ONLY, json.dumps(allowed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, "a gateway entry point needs more than `pip install .`:\n" + result.stderr[-3000:]


WITHOUT_WORKER_EXTRA = r"""
import importlib.abc, sys
class NoWorkerExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "triton", "safetensors", "matplotlib", "ninja"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoWorkerExtra())
from launch.cli import main
print(main(["replay", "synthetic:multiturn"]), main(["worker", "--model", "tiny", "--port", "0"]))
"""


def test_an_engine_command_without_the_worker_extra_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_WORKER_EXTRA], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["2", "2"]
    lines = result.stderr.splitlines()
    for command in ("replay", "worker"):
        line = next(line for line in lines if line.startswith(f"kvroute {command}: error: "))
        assert "needs torch, which the `worker` extra brings: pip install '.[worker]'" in line, line


# A plain `pip install .` can install xds-protos after opentelemetry-proto, whose older files then break the OTLP
# exporter's import this way (deploy/docker/otel-proto-over-xds.sh): the exporter is made to fail so here.
BROKEN_EXPORTER = r"""
import importlib.abc, sys
class BrokenExporter(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("opentelemetry.exporter"):
            raise ImportError("cannot import name 'InstrumentationScope' from 'opentelemetry.proto.common.v1'")
sys.meta_path.insert(0, BrokenExporter())
from launch.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_gateway_whose_otlp_exporter_does_not_import_serves_without_spans_and_says_why(tmp_path: Path) -> None:
    http_port = free_port()
    argv = kvroute_argv(
        "gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0",
        "--metrics-port", "0", "--workers", f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    argv[1:3] = ["-c", BROKEN_EXPORTER]  # `python -m launch.cli` with the broken exporter
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    with Fleet(tmp_path) as fleet:
        gateway = fleet.spawn("gateway", argv, env=env)
        gateway.wait_for_line(f"on http://127.0.0.1:{http_port}/v1", timeout_s=60)
        warning = gateway.wait_for_line("OTLP exporter does not import", timeout_s=5)
    assert "WARNING" in warning and "OTEL_EXPORTER_OTLP_ENDPOINT" in warning
    assert "pip install --no-deps --force-reinstall opentelemetry-proto==" in warning


LOAD_EXTENSION = r"""
import sys
from pathlib import Path
from kvkernels.cpu_backend import load_extension
loaded = load_extension("test op library", "kvroute_test_notice", Path(sys.argv[1]), [], ())
"""


def _test_op_library(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A tiny C++ op library's source, its build lock's path and an environment whose TORCH_EXTENSIONS_DIR is
    under tmp_path."""
    source = tmp_path / "notice.cpp"
    source.write_text("int kvroute_test_notice() { return 1; }\n")
    build_root = tmp_path / "torch_extensions"
    lock = build_root / "kvroute_test_notice" / "lock"
    lock.parent.mkdir(parents=True)
    return source, lock, {**os.environ, "TORCH_EXTENSIONS_DIR": str(build_root)}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the C++ kernels build on x86_64 only")
def test_a_kernel_load_that_waits_on_a_build_says_what_it_is_doing(tmp_path: Path) -> None:
    """A first start's kernel compiles took minutes without a word. Here the build is held by another process
    (torch's `lock` file in the extension's build directory, kept open as torch's build keeps it: what a second
    worker of `kvroute up` waits on while the first compiles), so the load waits past BUILD_NOTICE_S whatever the
    machine's speed."""
    source, lock, env = _test_op_library(tmp_path)
    held = os.open(lock, os.O_CREAT | os.O_EXCL)
    loader = subprocess.Popen(
        [sys.executable, "-c", LOAD_EXTENSION, str(source)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )

    def release() -> None:
        os.close(held)
        lock.unlink()

    releaser = threading.Timer(60, release)  # the load ends, and with it stderr, whatever it printed
    releaser.start()
    try:
        assert loader.stderr is not None
        notice = next((line for line in loader.stderr if "kvroute: compiling" in line), "")
    finally:
        releaser.cancel()
        if lock.exists():
            release()
        loader.wait(timeout=120)
    assert notice.startswith(f"kvroute: compiling the test op library (first use; cached under {lock.parent}")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the C++ kernels build on x86_64 only")
def test_a_stale_build_lock_is_removed_and_the_kernel_builds(tmp_path: Path) -> None:
    """A compile killed mid-way leaves torch's lock file behind, and every later load waited on it forever. A lock
    no process holds is removed, with a line on stderr naming it, and the library builds."""
    source, lock, env = _test_op_library(tmp_path)
    lock.touch()  # what a killed build leaves: the file, held by nobody
    result = subprocess.run(
        [sys.executable, "-c", LOAD_EXTENSION + "print(loaded)", str(source)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"kvroute: removing the stale build lock {lock}" in result.stderr
    assert result.stdout.strip() == "True", result.stderr
    assert (lock.parent / "kvroute_test_notice.so").exists()


HELD_LOCK_LOAD = r"""
import sys
from pathlib import Path
from kvkernels import cpu_backend
cpu_backend.BUILD_LOCK_WAIT_S = 1.0
print(cpu_backend.load_extension("test op library", "kvroute_test_notice", Path(sys.argv[1]), [], ()))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the C++ kernels build on x86_64 only")
def test_a_build_lock_held_too_long_fails_the_load_naming_the_file(tmp_path: Path) -> None:
    """A lock a live process holds past BUILD_LOCK_WAIT_S (a build hung elsewhere) ends the wait: the load says
    on stderr which file to delete, and the torch path runs instead."""
    source, lock, env = _test_op_library(tmp_path)
    held = os.open(lock, os.O_CREAT | os.O_EXCL)
    try:
        result = subprocess.run(
            [sys.executable, "-c", HELD_LOCK_LOAD, str(source)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.close(held)
    assert result.stdout.strip() == "False"
    assert f"held by process {os.getpid()}" in result.stderr
    assert f"if no build is running, delete {lock}" in result.stderr
    assert lock.exists()  # a live holder's lock is never removed
