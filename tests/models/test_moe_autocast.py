"""MoE experts under torch.autocast (the FSDP-free one-process trainer): bf16 compute, fp32 gradients."""

from __future__ import annotations

import pytest
import torch

from tandem.models.layers.moe import MoE


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_experts_run_in_autocast_dtype_and_trace_fullgraph(backend):
    torch.manual_seed(0)
    moe = MoE(64, 32, 4, 2, norm_topk_prob=True, backend=backend)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(2, 8, 64, requires_grad=True)
    reference = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()
    assert moe.experts.gate_up_proj.grad.dtype == torch.float32
    compiled = torch.compile(moe, fullgraph=backend == "grouped_mm", backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x), out, atol=0, rtol=0)
