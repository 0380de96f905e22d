"""The optimizer step's clip folded into fused AdamW, and the garbage collector run on a step schedule."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from tandem.trainer.gc_schedule import scheduled_gc
from tandem.trainer.parallel import clip_grad_norm_


def _two_models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, copy.deepcopy(model)


def _backward(model: torch.nn.Module, scale: float) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    (model(x).square().sum() * scale).backward()


@pytest.mark.parametrize("scale", [1e-4, 1e3], ids=["under-the-norm", "clipped"])
def test_fused_adamw_divides_by_the_clip_factor_as_clipping_first_would(scale):
    plain, folded = _two_models()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt_folded = torch.optim.AdamW(folded.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        _backward(plain, scale)
        _backward(folded, scale)
        grads = [p.grad.clone() for p in folded.parameters()]
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # scales the gradients in place
        got = clip_grad_norm_(folded, 1.0, opt_folded)  # leaves them: the optimizer divides
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        clipped = want > 1.0
        assert all(g.equal(p.grad) for g, p in zip(grads, folded.parameters(), strict=True)), "no pass over grads"
        opt_plain.step()
        opt_folded.step()
        for a, b in zip(plain.parameters(), folded.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        if clipped:  # the fold really happened: the unclipped step would be far off
            assert not torch.allclose(grads[0], plain[0].weight.grad)
        opt_plain.zero_grad()
        opt_folded.zero_grad()


def test_unfused_adamw_is_clipped_in_place():
    model, _ = _two_models()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    optimizer.grad_scale = torch.tensor(5.0)  # a stale factor is never left for the next step
    _backward(model, 1e3)
    norm = clip_grad_norm_(model, 1.0, optimizer)
    assert norm > 1.0 and not hasattr(optimizer, "grad_scale")
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(after, torch.tensor(1.0), rtol=1e-4, atol=0)
    optimizer.step()


def test_scheduled_gc_collects_between_steps_only(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    gc.enable()
    with scheduled_gc(3) as after_step:
        assert not gc.isenabled() and collected == [1]
        for done in range(8):
            after_step(done)
    assert collected == [1, 1, 1] and gc.isenabled()
    with pytest.raises(RuntimeError), scheduled_gc(3):
        raise RuntimeError("a failed step")
    assert gc.isenabled(), "automatic collection comes back however the block ends"
    with scheduled_gc(0) as after_step:
        after_step(50)
        assert gc.isenabled()
