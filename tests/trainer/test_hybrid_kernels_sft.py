"""`tandem sft` with the hybrid layers' Triton kernels trains as their torch paths do, step by step: Gated
DeltaNet's pass over chunks on a tiny Qwen3-Next (`--speed.delta-scan-kernel triton`) and Mamba-2's within-chunk
part on a tiny Nemotron-H (`--speed.ssd-kernel triton`).

On CPU the kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1, which the `tandem sft`
subprocess inherits); tests/kernels/test_delta_scan.py and test_ssd.py check the kernels themselves.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from support.hybrid_models import NEMOTRON_H_MOE, QWEN3_NEXT, write_servable_hybrid
from support.jsonl import read_metrics
from support.runs import sft_flags, tandem_sft


@pytest.mark.parametrize(
    ("config", "switch"),
    [(QWEN3_NEXT, "--speed.delta-scan-kernel"), (NEMOTRON_H_MOE, "--speed.ssd-kernel")],
    ids=["qwen3-next-delta-scan", "nemotron-h-ssd"],
)
def test_sft_with_the_triton_kernel_trains_as_torch(config, switch, tmp_path, reverse_text_jsonl):
    model = write_servable_hybrid(tmp_path / "model", config)
    losses = {}
    for kernel in ("torch", "triton"):
        flags = sft_flags(model, reverse_text_jsonl, tmp_path, kernel)
        tandem_sft(*flags, "--max-steps", "3", switch, kernel)
        losses[kernel] = [m["loss"] for m in read_metrics(tmp_path / kernel)]
    assert losses["triton"] == pytest.approx(losses["torch"], rel=1e-5)
    assert losses["torch"][-1] < losses["torch"][0]
