"""FusedPolicyLoss equals token_logprobs + policy_loss (the reference path) in value, metrics and gradients."""

from __future__ import annotations

import pytest
import torch

from tandem.config.trainer import LossConfig
from tandem.models import IGNORE_INDEX, Hidden, load_model, token_logprobs
from tandem.models.logprobs import kept_mask
from tandem.trainer.fused_loss import FusedPolicyLoss, PolicyTokens, _compiled, _logit_grad_, _scores
from tandem.trainer.loss import LossInputs, policy_loss

VOCAB, HIDDEN, TOKENS, K = 97, 16, 37, 6
IGNORED = [3, 20, 21]
FULL_VOCAB_ROW = 5
OUTSIDE_ROW = 11  # its target lies outside its kept ids: logprob -inf on both paths


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    return hidden, weight, _tokens(hidden, weight, g)


def _tokens(hidden: torch.Tensor, weight: torch.Tensor, g: torch.Generator) -> PolicyTokens:
    """Targets (some off the loss), kept ids (some rows the whole vocabulary), per-token temperatures, and
    inference logprobs near the trainer's, so every loss type has kept, masked and clipped tokens."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[IGNORED] = IGNORE_INDEX
    kept = torch.randint(0, vocab, (tokens, K), generator=g)
    kept[:, 0] = targets.clamp_min(0)
    kept[::3, 4:] = -1
    kept[FULL_VOCAB_ROW] = -1
    temperatures = torch.linspace(0.6, 1.4, tokens)
    with torch.no_grad():
        exact = token_logprobs(hidden, weight, targets, temperature=temperatures, kept_matrix=kept).logprobs
    inference = exact + 0.6 * torch.randn(tokens, generator=g)
    inference = inference.clamp_max(-1e-3).masked_fill(targets == IGNORE_INDEX, 0.7)  # off-loss values are ignored
    advantages = torch.randn(tokens, generator=g)
    weights = torch.rand(tokens, generator=g).masked_fill(targets == IGNORE_INDEX, 0.0)
    return PolicyTokens(
        targets=targets,
        temperatures=temperatures,
        kept_matrix=kept,
        inference_logprobs=inference,
        advantages=advantages,
        weights=weights / weights.sum(),
    )


def _reference(hidden, weight, tokens: PolicyTokens, config: LossConfig, with_entropy: bool):
    """trainer.rl's path: chunked logprobs, the loss tokens picked by boolean indexing, then policy_loss."""
    out = token_logprobs(
        hidden,
        weight,
        tokens.targets,
        temperature=tokens.temperatures,
        kept_matrix=tokens.kept_matrix,
        chunk_size=8,
        with_entropy=with_entropy,
    )
    on = tokens.targets != IGNORE_INDEX
    inputs = LossInputs(
        logprobs=out.logprobs[on],
        inference_logprobs=tokens.inference_logprobs[on],
        advantages=tokens.advantages[on],
        weights=tokens.weights[on],
        entropy=out.entropy[on] if with_entropy else None,
    )
    loss, metrics = policy_loss(config, inputs)
    return loss, metrics, out.logprobs.detach()


def _run(head, hidden, weight, scale: float = 0.37):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics, logprobs = head(hidden, weight)
    grad_hidden, grad_weight = torch.autograd.grad(loss * scale, (hidden, weight))
    return loss.detach(), metrics, logprobs, grad_hidden, grad_weight


def _assert_same(ours, ref, rtol=1e-5, atol=1e-6):
    for name, a, b in zip(("loss", "metrics", "logprobs", "grad hidden", "grad weight"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=name)


CONFIGS = [
    LossConfig(type="ipo", ipo_eps=0.1),
    LossConfig(type="icepop", icepop_low=0.7, icepop_high=1.5),
    LossConfig(type="ppo", ppo_clip=0.1),
    LossConfig(type="cispo", cispo_eps_high=0.1),
]


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.type)
def test_matches_reference(config, kl_coef):
    config = config.model_copy(update={"kl_coef": kl_coef})
    hidden, weight, tokens = _tensors()
    tokens.kept_matrix[OUTSIDE_ROW] = (tokens.targets[OUTSIDE_ROW] + 1 + torch.arange(K)) % VOCAB
    tokens.kept_matrix[OUTSIDE_ROW, 2:] = -1
    tokens.weights[OUTSIDE_ROW] = 0.0  # such a token is never sampled; here it is only carried through
    ours = _run(FusedPolicyLoss(tokens, config, 8), hidden, weight)
    ref = _run(lambda h, w: _reference(h, w, tokens, config, True), hidden, weight)
    assert ours[2][OUTSIDE_ROW] == -torch.inf and (ours[2][IGNORED] == 0).all()
    # w = 0 times that token's infinite k3 is NaN on both paths (and so is the loss with kl_coef > 0 or cispo)
    assert torch.isnan(ref[1]["mismatch_kl"])
    _assert_same(ours, ref)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.type)
@pytest.mark.parametrize("chunk_size", [5, 37, 1024])  # ragged last chunk, exact, one chunk
@pytest.mark.parametrize("with_entropy", [True, False])
def test_matches_reference_on_sampled_tokens(config, chunk_size, with_entropy):
    """Every target among its kept ids (as sampling guarantees): value, every metric, both gradients."""
    config = config.model_copy(update={"kl_coef": 0.05})
    hidden, weight, tokens = _tensors(seed=1)
    ours = _run(FusedPolicyLoss(tokens, config, chunk_size, with_entropy), hidden, weight)
    ref = _run(lambda h, w: _reference(h, w, tokens, config, with_entropy), hidden, weight)
    names = {"masked_low", "masked_high", "mismatch_kl", "ratio", "clip_fraction"}
    assert set(ours[1]) == set(ref[1]) == (names | {"entropy"} if with_entropy else names)
    assert all(torch.isfinite(value) for value in ref[1].values())
    _assert_same(ours, ref)


def test_masks_and_clips_are_exercised():
    """The inputs above reach both sides of each loss's mask or clip, so the comparisons test them."""
    hidden, weight, tokens = _tensors(seed=1)
    for config in CONFIGS:
        _, metrics, _ = _reference(hidden, weight, tokens, config, True)
        if config.type in ("ipo", "icepop"):
            assert metrics["masked_low"] > 0 and metrics["masked_high"] > 0, config.type
            assert metrics["masked_low"] + metrics["masked_high"] < 0.9, config.type
        else:
            assert 0 < metrics["clip_fraction"] < 0.9, config.type


def test_no_kept_ids():
    hidden, weight, tokens = _tensors(seed=2)
    tokens.kept_matrix = None
    config = LossConfig(kl_coef=0.1)
    _assert_same(
        _run(FusedPolicyLoss(tokens, config, 16), hidden, weight),
        _run(lambda h, w: _reference(h, w, tokens, config, True), hidden, weight),
    )


def test_autocast_bf16_close_to_fp32_reference():
    """fp32 weights under autocast: bf16 matmuls, fp32 loss and gradients, within bf16 tolerance."""
    hidden, weight, tokens = _tensors(seed=1)
    config = LossConfig(type="cispo", kl_coef=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _run(FusedPolicyLoss(tokens, config, 8), hidden, weight)
    ref = _run(lambda h, w: _reference(h, w, tokens, config, True), hidden, weight)
    assert ours[0].dtype == ours[3].dtype == ours[4].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0], rtol=3e-2, atol=1e-2)
    torch.testing.assert_close(ours[2], ref[2], rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(ours[3], ref[3], rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(ours[4], ref[4], rtol=5e-2, atol=5e-3)


def test_backward_runs_once():
    hidden, weight, tokens = _tensors()
    hidden.requires_grad_(True)
    loss, _, _ = FusedPolicyLoss(tokens, LossConfig(), 8)(hidden, weight)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def test_through_the_model_head(tiny_model_dir):
    """`CausalLM(..., head=FusedPolicyLoss(...))` gives every parameter the reference path's gradient."""
    model = load_model(tiny_model_dir("qwen3"))
    ids = torch.randint(3, model.args.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model(ids, head=Hidden())[0]
    tokens = _tokens(hidden, model.lm_head_weight, torch.Generator().manual_seed(6))
    config = LossConfig(type="ppo", ppo_clip=0.1, kl_coef=0.05)

    loss, metrics, _ = model(ids, head=FusedPolicyLoss(tokens, config, 8))
    loss.backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref_loss, ref_metrics, _ = _reference(model(ids, head=Hidden())[0], model.lm_head_weight, tokens, config, True)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics, ref_metrics, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kept", [True, False])
def test_compiled_chunk_kernels_match_eager(kept):
    """The kernels CUDA runs compiled (softmax scores, then the gradient written over the logits) trace and
    give the eager results; compiled here for the CPU, the same graphs."""
    hidden, weight, tokens = _tensors()
    logits = hidden @ weight.T
    mask = kept_mask(tokens.kept_matrix, VOCAB) if kept else None
    targets, temperatures = tokens.targets.clamp_min(0), tokens.temperatures
    scores, logit_grad_ = _compiled()
    for with_entropy in (True, False):
        want = _scores(logits, temperatures, mask, targets, with_entropy)
        torch.testing.assert_close(
            scores(logits, temperatures, mask, targets, with_entropy), want, rtol=1e-5, atol=1e-6
        )
    lse, grad = want[1], torch.randn(TOKENS, generator=torch.Generator().manual_seed(3))
    compiled, eager = logits.clone(), logits.clone()
    logit_grad_(compiled, temperatures, mask, targets, lse, grad)
    _logit_grad_(eager, temperatures, mask, targets, lse, grad)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 weights", "fp32 weights under autocast"])
def test_cuda_bf16_close_to_fp32_reference(autocast):
    """The GPU path: compiled chunk kernels, bf16 GEMMs accumulating in fp32 (`out_dtype`)."""
    hidden, weight, tokens = _tensors(seed=1)
    tokens = PolicyTokens(**{name: None if t is None else t.cuda() for name, t in vars(tokens).items()})
    config = LossConfig(type="ppo", ppo_clip=0.1, kl_coef=0.05)
    ref = _run(lambda h, w: _reference(h, w, tokens, config, True), hidden.cuda(), weight.cuda())
    if autocast:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours = _run(FusedPolicyLoss(tokens, config, 8), hidden.cuda(), weight.cuda())
    else:
        ours = _run(FusedPolicyLoss(tokens, config, 8), hidden.cuda().bfloat16(), weight.cuda().bfloat16())
    torch.testing.assert_close(ours[0], ref[0], rtol=3e-2, atol=1e-2)
    torch.testing.assert_close(ours[2], ref[2], rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(ours[3].float(), ref[3], rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(ours[4].float(), ref[4], rtol=5e-2, atol=5e-3)
