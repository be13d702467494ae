"""`python -m kvkernels` (run by `make setup`): compile every C++ CPU kernel this machine can run, so that no request
waits for the compiler; each one it cannot run says why and what runs instead."""

import logging

from kvkernels import cpu_backend, cpu_fused_ops, cpu_linear, cpu_weight_only

logging.basicConfig(format="%(message)s")
for name, load in (
    ("AVX-512 BF16 attention kernel", cpu_backend.load_kernel),
    ("AVX2 float32 attention kernel", cpu_backend.load_fp32_kernel),
    ("AVX2 bf16 linear kernel", cpu_linear.load_kernel),
    ("AVX2 fused float32 ops", cpu_fused_ops.load_kernel),
    ("weight-only int8/int4 linear kernel", cpu_weight_only.load_kernel),
):
    print(f"{name}: {'ready' if load() else 'unavailable, torch runs instead'}")
