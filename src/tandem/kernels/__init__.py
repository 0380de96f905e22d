"""Triton kernels, each checked against a plain-torch reference. Imports nothing else from tandem.

Every kernel here is optional: callers keep the torch path and pick a kernel by a config switch, and
only importing a kernel's module needs Triton.
"""

import importlib.util
import os

FP32_PRODUCTS = "tf32x3"
"""`tl.dot`'s input precision in the kernels that score as fp32 torch does (the hybrid layers' scans): each fp32
operand split into a tf32 high and low part, three tensor-core products summed (hi*hi + hi*lo + lo*hi), within
about 1e-6 of fp32 ones; "ieee" (fp32 FMAs) is several times slower, plain "tf32" (1e-3) too coarse."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton runs kernels under its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(device_type: str) -> str | None:
    """Why Triton kernels cannot run on `device_type` here, or None when they can."""
    if not triton_available():
        return "the triton package is missing"
    if device_type != "cuda" and not triton_interpreted():
        return "Triton kernels need CUDA (or TRITON_INTERPRET=1, for tests)"
    return None
