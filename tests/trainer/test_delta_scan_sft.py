"""`tandem sft --speed.delta-scan-kernel triton` on a tiny Qwen3-Next trains as the torch loop does, step by step.

On CPU the Triton kernel runs under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1, which the `tandem
sft` subprocess inherits); tests/kernels/test_delta_scan.py checks the kernel itself.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the Triton scan needs the triton package")

from support.hybrid_models import write_servable_hybrid
from support.jsonl import read_metrics
from support.runs import sft_flags, tandem_sft


def test_sft_with_the_triton_scan_trains_as_the_loop(tmp_path, reverse_text_jsonl):
    model = write_servable_hybrid(tmp_path / "model")
    losses = {}
    for kernel in ("torch", "triton"):
        flags = sft_flags(model, reverse_text_jsonl, tmp_path, kernel)
        tandem_sft(*flags, "--max-steps", "3", "--speed.delta-scan-kernel", kernel)
        losses[kernel] = [m["loss"] for m in read_metrics(tmp_path / kernel)]
    assert losses["triton"] == pytest.approx(losses["torch"], rel=1e-5)
    assert losses["torch"][-1] < losses["torch"][0]
