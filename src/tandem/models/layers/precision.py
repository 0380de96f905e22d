"""The compute dtype under torch.autocast, for the places autocast does not cast by itself."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """torch.autocast's compute dtype when it is on for `device_type` (fp32 weights, bf16 matmuls), else None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
