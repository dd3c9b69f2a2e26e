"""The quantized template variants compile for an H100/H200 (sm_90) here, without a GPU:
kernels/triton/aot_compile.py builds each to a cubin with the Triton wheel's own ptxas, which
catches what the interpreter lets through (dot operand types and sizes, broadcasts, pointer
casts). It runs in a child process because conftest puts this one's Triton in interpreter mode.
A cold Triton cache takes ~40 s on two busy cores; a warm one ~4 s."""

from __future__ import annotations

import os
import subprocess
import sys


def test_quantized_templates_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "llmc.kernels.triton.aot_compile", "--quick"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "FAIL" not in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("OK") == 7, run.stdout
