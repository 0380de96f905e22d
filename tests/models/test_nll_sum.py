"""fused_nll_sum (SFT's loss, gradient formed in the forward) equals the plain summed cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models import IGNORE_INDEX, fused_nll_sum, load_model, token_logprobs


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
    ours = model(ids, targets=targets, chunk_size=4, nll_sum=True)
    ours.backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref = -model(ids, targets=targets, chunk_size=4, with_entropy=False).logprobs.sum()
    ref.backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
