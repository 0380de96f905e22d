"""Triton kernels, each checked against a plain-torch reference. Imports nothing else from tandem.

Every kernel here is optional: callers keep the torch path and pick a kernel by a config switch, and
only importing a kernel's module needs Triton.
"""

import importlib.util
import os


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
