"""The package as a user installs it (issue 28, item 5): `pip install .` brings the gateway's dependencies only
(no torch), the engine comes with the `worker` extra, and an engine command without it says what to install."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from launch.cli import WORKER_EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
WORKER_ONLY = {"torch", "triton", "safetensors", "matplotlib", "ninja"}  # tqdm comes with gguf too

# Every installed module whose distribution `pip install .` does not bring fails to import, as on a gateway host.
BASE_INSTALL_ONLY = r"""
import importlib, importlib.abc, importlib.metadata, json, sys
allowed = set(json.loads(sys.argv[1]))
ours = {"gateway", "kvroute", "launch", "proto", "worker", "kernels", "sim", "loadtest", "benchmarks"}
absent = {module for module, dists in importlib.metadata.packages_distributions().items()
          if not any(dist.lower().replace("_", "-") in allowed for dist in dists)} - ours
class BaseInstall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"`pip install .` brings no {name}", name=name)
sys.meta_path.insert(0, BaseInstall())
from launch.cli import build_parser
for command in ("gateway", "epp", "export-tokenizer"):
    build_parser([command])
import gateway.cli_gateway, gateway.cli_epp
assert "torch" not in sys.modules and "triton" not in sys.modules
"""


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
        assert "needs torch, which the `worker` extra brings: pip install 'kvroute[worker]'" in line, line
