"""The CPU-dependent tests pass on every x86 class the engine's choices distinguish (AVX2-only, AVX-512 BF16, AMX),
proven on one machine: the main run covers this machine's own class, and each class below it reruns those tests in
a child pytest under the class's environment (kvkernels.cpu_backend.CPU_CLASSES: our flags hidden, torch's, oneDNN's
and MKL's dispatch capped). A class above this machine cannot be emulated (flags can be hidden, not added) and
skips, naming the machine's class."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvkernels.cpu_backend import CPU_CLASSES, cpu_class

ROOT = Path(__file__).resolve().parents[1]
# The tests whose outcome depends on the CPU's flags: dtype and attention-path choices, the C++ kernels (their
# skip marks are read at import, so a child process is the only honest way to take another class's branches).
CPU_DEPENDENT_TESTS = (
    "tests/test_dtype.py",
    "tests/test_kernels_cpu.py",
    "tests/test_kernels_cpu_fused.py",
    "tests/test_cpu_weight_only.py",
)
CLASS_ORDER = list(CPU_CLASSES)
HERE = cpu_class()


@pytest.mark.parametrize("cpu_class_name", CLASS_ORDER)
def test_cpu_dependent_tests_pass_under_each_class(cpu_class_name: str) -> None:
    if HERE is None:
        pytest.skip("this CPU is below every class (no AVX2 and FMA, or not x86): the main run covers it")
    if cpu_class_name == HERE:
        pytest.skip(f"this machine is the {HERE} class: the main run covers it")
    if CLASS_ORDER.index(cpu_class_name) > CLASS_ORDER.index(HERE):
        pytest.skip(f"this machine is the {HERE} class; {cpu_class_name} needs flags it lacks")
    env = {**os.environ, **CPU_CLASSES[cpu_class_name]}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CPU_DEPENDENT_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = child.stdout[-4000:] + child.stderr[-2000:]
    assert child.returncode == 0, f"under the {cpu_class_name} class:\n{tail}"
    assert " passed" in child.stdout.splitlines()[-1], tail
