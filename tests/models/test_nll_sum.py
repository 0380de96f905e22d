"""fused_nll_sum (SFT's loss, gradient formed in the forward) equals the plain summed cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models import IGNORE_INDEX, Logprobs, NllSum, fused_nll_sum, load_model, token_logprobs


def _inputs(dtype: torch.dtype = torch.float32, tokens: int = 37, vocab: int = 97, hidden: int = 16):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[[3, 20]] = IGNORE_INDEX
    return h, w, targets


@pytest.mark.parametrize("chunk_size", [5, 37, 1024])  # ragged last chunk, exact, one chunk
def test_matches_full_logits_cross_entropy(chunk_size):
    h, w, targets = _inputs()
    scale = torch.tensor(0.37)  # the trainer divides by the step's token count before backward
    ours = fused_nll_sum(h, w, targets, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad(ours * scale, (h, w))
    ref = F.cross_entropy(h @ w.T, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    rh, rw = torch.autograd.grad(ref * scale, (h, w))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(gh, rh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-6, rtol=1e-5)


def test_bf16_value_equals_chunked_logprobs():
    """Same bf16 matmul and fp32 softmax as token_logprobs; gradients come back in bf16."""
    h, w, targets = _inputs(torch.bfloat16)
    ours = fused_nll_sum(h, w, targets, chunk_size=8)
    ref = -token_logprobs(h, w, targets, chunk_size=8, with_entropy=False).logprobs.sum()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-6)
    gh, gw = torch.autograd.grad(ours, (h, w))
    assert gh.dtype == gw.dtype == torch.bfloat16 and torch.isfinite(gw).all()


def test_model_forward_nll_sum(model_dir):
    model = load_model(model_dir("qwen3"))
    ids = torch.randint(3, model.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    targets = ids.roll(-1, dims=1)
    targets[0, :3] = IGNORE_INDEX
    ours = model(ids, head=NllSum(targets, chunk_size=4))
    ours.backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref = -model(ids, head=Logprobs(targets, chunk_size=4, with_entropy=False)).logprobs.sum()
    ref.backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def test_autocast_fp32_weights(device):
    """The one-process trainer's case: fp32 weights under autocast. Matmuls in bf16, gradients fp32 and close to
    the fp32 reference; on CUDA the weight gradient accumulates in fp32 inside the GEMM (`out_dtype`)."""
    h, w, targets = _inputs(tokens=300, vocab=512, hidden=64)
    h, w, targets = (t.detach().to(device) for t in (h, w, targets))
    h.requires_grad_(True)
    w.requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = fused_nll_sum(h, w, targets, chunk_size=128)
    gh, gw = torch.autograd.grad(ours / 300, (h, w))
    assert ours.dtype == gh.dtype == gw.dtype == torch.float32
    ref = F.cross_entropy(h @ w.T, targets, reduction="sum", ignore_index=IGNORE_INDEX)
    rh, rw = torch.autograd.grad(ref / 300, (h, w))
    torch.testing.assert_close(ours, ref, atol=0, rtol=2e-2)
    torch.testing.assert_close(gh, rh, atol=2e-3, rtol=5e-2)
    torch.testing.assert_close(gw, rw, atol=2e-3, rtol=5e-2)


def test_backward_runs_once():
    """The saved gradients are scaled in place (no second [V, H] buffer), so a retained graph cannot replay."""
    h, w, targets = _inputs()
    loss = fused_nll_sum(h, w, targets, chunk_size=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()
