"""`CausalLM.forward` returns its head's result, the head given the final hidden states `[B, S, H]` and the LM
head's weight from inside the forward; the heads of `models.heads` are what the forward's flags used to give."""

from __future__ import annotations

import torch

from tandem.models import Hidden, Logits, Logprobs, NllSum, load_model, token_logprobs
from tandem.models.nll_sum import fused_nll_sum


def test_the_forward_returns_its_heads_result(model_dir):
    model = load_model(model_dir("qwen3"))
    ids = torch.randint(3, model.args.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    seen = []

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> object:
        seen.append((hidden.shape, weight))
        return seen

    assert model(ids, head=head) is seen
    assert seen == [(torch.Size([2, 7, model.args.hidden_size]), model.lm_head_weight)]
    with torch.no_grad():
        hidden = model(ids, head=Hidden())
        assert torch.equal(model(ids), model(ids, head=Logits()))
        assert torch.equal(model(ids), hidden @ model.lm_head_weight.T)
        assert torch.equal(model(ids), model.compute_logits(hidden))
        targets = ids.roll(-1, 1)
        ours = model(ids, head=Logprobs(targets, temperature=0.9, chunk_size=3))
        want = token_logprobs(hidden, model.lm_head_weight, targets, temperature=0.9, chunk_size=3)
        assert torch.equal(ours.logprobs, want.logprobs) and torch.equal(ours.entropy, want.entropy)
        assert model(ids, head=Logprobs(targets, with_entropy=False)).entropy is None
    nll = model(ids, head=NllSum(targets, chunk_size=4))
    assert torch.equal(nll.detach(), fused_nll_sum(hidden, model.lm_head_weight, targets, chunk_size=4).detach())
