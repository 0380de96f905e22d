"""Chunked logprobs / entropy / cross-entropy equal the plain full-logits computation, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.tolerance import assert_close_scaled
from tandem.models import (
    IGNORE_INDEX,
    Hidden,
    Logprobs,
    cross_entropy,
    load_model,
    reference_token_logprobs,
    token_logprobs,
)

VOCAB, HIDDEN, TOKENS = 97, 16, 37


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[[3, 20]] = IGNORE_INDEX
    return hidden, weight, targets


def _kept_matrix(targets: torch.Tensor) -> torch.Tensor:
    """A kept matrix: per token up to 6 kept ids (the target among them), padded with -1; token 5 keeps the full
    vocab."""
    g = torch.Generator().manual_seed(7)
    kept = torch.randint(0, VOCAB, (TOKENS, 6), generator=g)
    kept[:, 0] = targets.clamp_min(0)
    kept[::3, 4:] = -1
    kept[5] = -1
    return kept


def _loss_and_grads(fn, hidden, weight, **kw):
    out = fn(hidden, weight, **kw)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)
    loss = (a * out.logprobs).sum() + (b * out.entropy).sum()
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    return out.logprobs.detach(), out.entropy.detach(), gh, gw


CASES = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "per-token temperature": {"temperature": torch.linspace(0.5, 1.5, TOKENS)},
    "kept ids": {"kept": True},
    "kept ids + temperature": {"kept": True, "temperature": 1.3},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk_size", [8, 1024])
def test_chunked_matches_reference(case, chunk_size):
    hidden, weight, targets = _inputs()
    kw = dict(CASES[case])
    if kw.pop("kept", False):
        kw["kept_matrix"] = _kept_matrix(targets)
    ours = _loss_and_grads(token_logprobs, hidden, weight, targets=targets, chunk_size=chunk_size, **kw)
    ref = _loss_and_grads(reference_token_logprobs, hidden, weight, targets=targets, **kw)
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert (ours[0][[3, 20]] == 0).all(), "ignored targets have logprob 0"
    if "kept_matrix" in kw:
        restricted = torch.arange(TOKENS) != 5  # row 5 keeps the whole vocabulary
        assert (ours[1][restricted] <= torch.log(torch.tensor(6.0)) + 1e-5).all(), "entropy over <= 6 kept ids"


def test_kept_ids_renormalise():
    hidden, weight, targets = _inputs()
    kept = _kept_matrix(targets)
    out = token_logprobs(hidden, weight, targets, kept_matrix=kept).logprobs
    full = token_logprobs(hidden, weight, targets).logprobs
    assert (out >= full - 1e-6).all() and (out > full + 1e-3).any()
    torch.testing.assert_close(out[5], full[5])  # an all -1 row keeps the whole vocabulary
    outside = kept.clone()
    outside[0, 0] = (targets[0] + 1) % VOCAB
    outside[0, 1:] = -1
    assert token_logprobs(hidden, weight, targets, kept_matrix=outside).logprobs[0] == -torch.inf


def test_only_one_output_used():
    hidden, weight, targets = _inputs()
    for field in ("logprobs", "entropy"):
        ours = torch.autograd.grad(getattr(token_logprobs(hidden, weight, targets, chunk_size=5), field).sum(), hidden)
        ref = torch.autograd.grad(getattr(reference_token_logprobs(hidden, weight, targets), field).sum(), hidden)
        torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5, msg=field)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(reduction):
    hidden, weight, targets = _inputs()
    ours = cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=8)
    ref = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    ours_g = torch.autograd.grad(ours.sum(), (hidden, weight))
    ref_g = torch.autograd.grad(ref.sum(), (hidden, weight))
    for a, b in zip(ours_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32_reference():
    hidden, weight, targets = _inputs(dtype=torch.bfloat16)
    ours = token_logprobs(hidden, weight, targets, chunk_size=8)
    ref = reference_token_logprobs(hidden, weight, targets)
    assert ours.logprobs.dtype == torch.float32
    torch.testing.assert_close(ours.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)  # same bf16 matmul, fp32 after
    gw = torch.autograd.grad(ours.logprobs.sum(), weight)[0]
    assert gw.dtype == torch.bfloat16 and torch.isfinite(gw).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_bf16_weight_gradient_close_to_fp32_reference():
    """On CUDA the bf16 weight gradient's GEMM runs in bf16 with fp32 accumulation (not an fp32 SIMT SGEMM)."""
    hidden, weight, targets = (t.detach().cuda() for t in _inputs())
    kept = _kept_matrix(targets.cpu()).cuda()
    g = torch.randn(TOKENS, generator=torch.Generator().manual_seed(9)).cuda()
    grads = []
    for dtype in (torch.bfloat16, torch.float32):
        w = weight.to(dtype).requires_grad_(True)
        out = token_logprobs(hidden.to(dtype), w, targets, temperature=0.8, kept_matrix=kept, chunk_size=8)
        grads.append(torch.autograd.grad((g * out.logprobs).sum() + out.entropy.sum(), w)[0])
    assert grads[0].dtype == torch.bfloat16
    # bf16 inputs and output rounding: ~0.5 bf16 ulps of the largest gradient on CPU; 2 ulps is 1.6% of it
    assert_close_scaled(grads[0].float(), grads[1], 2, dtype=torch.bfloat16, msg="bf16 weight gradient")


def test_model_forward_with_targets(model_dir):
    model = load_model(model_dir("qwen3"))
    ids = torch.randint(3, model.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    targets = ids.roll(-1, dims=1)
    out = model(ids, head=Logprobs(targets, temperature=0.8, chunk_size=4))
    logits = model(ids)
    ref = (logits.float() / 0.8).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=1e-5)
    no_entropy = model(ids, head=Logprobs(targets, temperature=0.8, with_entropy=False))
    assert no_entropy.entropy is None
    torch.testing.assert_close(no_entropy.logprobs, out.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(model(ids, head=Hidden()) @ model.lm_head_weight.T, logits)
