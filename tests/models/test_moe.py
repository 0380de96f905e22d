"""MoE: backends agree in outputs and gradients; the grouped_mm fallback is logged; frozen routers get no grad."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from support.model_parity import assert_backends_agree
from support.tolerance import K_REORDERED, assert_close_scaled
from tandem.models import ModelRuntime, load_model
from tandem.models.layers import moe as moe_module
from tandem.models.layers.moe import MoE, route

# DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, correction bias, 1 of 2 expert groups, scaled, shared experts.
SIGMOID_GROUPED = {
    "scoring": "sigmoid",
    "score_correction_bias": True,
    "n_group": 2,
    "topk_group": 1,
    "scaling_factor": 2.5,
    "shared_intermediate_size": 24,
}


def _moe(backend: str, freeze_router: bool = False, seed: int = 0, **options) -> MoE:
    layer = MoE(64, 32, 8, 2, True, backend=backend, freeze_router=freeze_router, **options)
    g = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    return layer


def _run(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), grads


@pytest.mark.parametrize("routing", ["softmax", "sigmoid_grouped"])
@pytest.mark.parametrize("tokens", [3, 40])  # 3 tokens x top-2 leaves most of the 8 experts empty
def test_grouped_mm_matches_loop(tokens, routing):
    options = SIGMOID_GROUPED if routing == "sigmoid_grouped" else {}
    x = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(1))
    out_loop, grads_loop = _run(_moe("loop", **options), x)
    out_gmm, grads_gmm = _run(_moe("grouped_mm", **options), x)
    assert_close_scaled(out_gmm, out_loop, K_REORDERED, msg="output")
    for name, grad in grads_loop.items():
        if name == "router.e_score_correction_bias":  # set by load balancing, never by gradients
            assert grad is None and grads_gmm[name] is None
            continue
        assert grad is not None and grad.abs().sum() > 0, name
        assert_close_scaled(grads_gmm[name], grad, K_REORDERED, msg=name)


def test_sigmoid_group_routing_matches_transformers():
    """Same experts and weights as transformers' DeepSeek-V3 router, with a bias that changes the choice."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=64, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    ours = _moe("loop", **{**SIGMOID_GROUPED, "n_group": 4, "topk_group": 2}).router
    ours.top_k = 3
    theirs = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ours.e_score_correction_bias.uniform_(-0.3, 0.3)
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(5))
    weights, experts = ours(x)
    _, ref_weights, ref_experts = theirs(x)
    order, ref_order = experts.argsort(-1), ref_experts.argsort(-1)
    assert torch.equal(experts.gather(-1, order), ref_experts.gather(-1, ref_order))
    torch.testing.assert_close(weights.gather(-1, order), ref_weights.gather(-1, ref_order))
    unbiased = route(F.linear(x, ours.weight), 3, True, scoring="sigmoid", n_group=4, topk_group=2)[1]
    assert not torch.equal(unbiased.sort(-1).values, experts.sort(-1).values), "the bias should change the choice"


def test_grouped_mm_fallback_matches_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(moe_module, "_grouped_mm_unsupported", lambda a, b: "forced by test")
    moe_module._warn_fallback.cache_clear()
    x = torch.randn(1, 17, 64, generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger=moe_module.__name__):
        out_fallback, grads_fallback = _run(_moe("grouped_mm"), x)
        _run(_moe("grouped_mm"), x)
    out_loop, grads_loop = _run(_moe("loop"), x)
    assert_close_scaled(out_fallback, out_loop, K_REORDERED, msg="output")
    for name, grad in grads_loop.items():
        assert_close_scaled(grads_fallback[name], grad, K_REORDERED, msg=name)
    warnings = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1 and "forced by test" in warnings[0].getMessage()


def test_grouped_mm_unsupported_reasons():
    a, b = torch.zeros(4, 6), torch.zeros(2, 6, 8)
    assert "16 bytes" in moe_module._grouped_mm_unsupported(a, b)
    assert moe_module._grouped_mm_unsupported(torch.zeros(4, 8), torch.zeros(2, 8, 8)) is None


@pytest.mark.parametrize("routing", ["softmax", "sigmoid_grouped"])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_frozen_router_gets_no_gradient(backend, routing):
    options = SIGMOID_GROUPED if routing == "sigmoid_grouped" else {}
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(3))
    out_frozen, grads = _run(_moe(backend, freeze_router=True, **options), x)
    out_free, _ = _run(_moe(backend, freeze_router=False, **options), x)
    assert grads["router.weight"] is None and grads.get("router.e_score_correction_bias") is None
    assert grads["experts.gate_up_proj"] is not None and grads["x"] is not None
    torch.testing.assert_close(out_frozen, out_free)  # freezing changes gradients only


def test_routing_is_fp32_softmax_topk():
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    weights, experts = route(logits, top_k=2, norm_topk_prob=True)
    probs = logits.float().softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    assert weights.dtype == torch.bfloat16 and torch.equal(experts, idx)
    torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).bfloat16())


def test_full_model_backends_agree_per_layer(model_dir):
    path = model_dir("qwen3_moe")
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(4))
    mixed = load_model(path, runtime=ModelRuntime(moe_backend=["grouped_mm", "loop"]))
    assert [layer.mlp.backend for layer in mixed.layers] == ["grouped_mm", "loop"]
    assert_backends_agree(functools.partial(load_model, path), ids)


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown MoE backend 'triton'"):
        MoE(64, 32, 4, 2, True, backend="triton")


def test_balanced_routing_gives_every_expert_the_same_tokens():
    logits = torch.randn(12, 8)
    weights, experts = route(logits, top_k=2, norm_topk_prob=True, balanced=True)
    assert torch.equal(experts.flatten().bincount(minlength=8), torch.full((8,), 3))
    assert all(len(set(row.tolist())) == 2 for row in experts)  # distinct experts per token
    chosen = logits.softmax(-1).gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
