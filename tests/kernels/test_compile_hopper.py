"""Every Triton kernel compiles for Hopper (sm_90) on this CPU machine, as a GPU would compile it.

The interpreter that runs the kernels in the other tests does not type-check them like the compiler does, so
a kernel can pass every CPU test and fail to build on a GPU. `compile_hopper.py` compiles each launch with the
ptxas the triton wheel ships; it runs in its own process because the interpreter replaces `triton.jit` for
the whole process once TRITON_INTERPRET is set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the kernels need the triton package")


def _ptxas() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not _ptxas().exists(), reason="this triton wheel ships no ptxas to compile for NVIDIA GPUs")
def test_every_kernel_compiles_for_hopper():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_hopper.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") >= 10, done.stdout  # every launch compiled, none skipped
