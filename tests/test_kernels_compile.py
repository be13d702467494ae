"""Every Triton kernel variant compiles for sm_80 and sm_90, on a machine without a GPU.

The interpreted tests check the kernels' arithmetic but compile nothing; this catches what only the GPU
compiler rejects. It runs in a fresh process because triton.jit reads TRITON_INTERPRET at import time.
"""

import os
import subprocess
import sys


def test_triton_kernels_compile_for_cuda_targets():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a deprecation warning of triton 3.9
    result = subprocess.run(
        [sys.executable, "-m", "kvkernels.compile_check"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
