"""`tandem sft` with the hybrid layers' Triton kernels trains as their torch paths do, step by step: Gated
DeltaNet's pass over chunks on a tiny Qwen3-Next (`--speed.delta-scan-kernel triton`) and Mamba-2's within-chunk
part on a tiny Nemotron-H (`--speed.ssd-kernel triton`).

On CPU the kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1, which the `tandem sft`
subprocess inherits); tests/kernels/test_delta_scan.py and test_ssd.py check the kernels themselves.
"""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling around Triton's interpreter proves nothing")
@pytest.mark.parametrize(
    ("config", "switch"),
    [(QWEN3_NEXT, "--speed.delta-scan-kernel"), (NEMOTRON_H_MOE, "--speed.ssd-kernel")],
    ids=["qwen3-next-delta-scan", "nemotron-h-ssd"],
)
def test_compiled_blocks_run_the_triton_kernels_as_eager(config, switch, tmp_path, reverse_text_jsonl):
    """`--compile --no-fullgraph` (each block compiled, the kernels called eagerly between graphs): the eager
    run's losses."""
    model = write_servable_hybrid(tmp_path / "model", config)
    losses = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile", "--no-fullgraph"))):
        tandem_sft(*sft_flags(model, reverse_text_jsonl, tmp_path, name), "--max-steps", "3", switch, "triton", *extra)
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)


def test_fullgraph_compile_keeps_the_hybrid_layers_on_torch():
    """Blocks compiled with fullgraph cannot call the chunked kernels (a graph break): `auto` takes the torch path
    there, an explicit `triton` is a ConfigError that says what to change."""
    from tandem.config import ConfigError
    from tandem.config.training import SpeedConfig
    from tandem.trainer.loop import model_runtime

    runtime = model_runtime(SpeedConfig(), torch.device("cuda"), fullgraph=True)
    assert runtime["delta_scan_backend"] == runtime["ssd_backend"] == "torch"
    with pytest.raises(ConfigError, match=r"speed.ssd_kernel = triton runs outside torch.compile.*fullgraph = false"):
        model_runtime(SpeedConfig(ssd_kernel="triton"), torch.device("cuda"), fullgraph=True)
