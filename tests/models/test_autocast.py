"""The model under torch.autocast (the FSDP-free one-process trainer): bf16 compute, fp32 gradients."""

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


def test_dense_attention_stays_in_autocast_dtype(tiny_model_dir):
    """Under autocast with fp32 weights, qk-norm and RoPE run in bf16 like a bf16 model (the fp32 norm weight and
    the fp32 residual stream promote nothing), and the logits stay close to the fp32 forward."""
    from tandem.models import load_model
    from tandem.models.layers.norm import RMSNorm

    norm = RMSNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert norm(torch.randn(2, 8)).dtype == torch.float32
    model = load_model(tiny_model_dir("qwen3"))
    seen = []
    model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: seen.append(args[1].dtype))
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert seen == [torch.float32, torch.bfloat16]  # the cos table: fp32 forward, then autocast's dtype
    torch.testing.assert_close(logits.float(), reference, atol=5e-2, rtol=5e-2)
