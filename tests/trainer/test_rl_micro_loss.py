"""The RL micro-batch loss over whole flattened micro-batches (no boolean-mask indexing, so no host syncs):
positions off the loss add exactly nothing, and the loss and metrics are those of the loss tokens alone."""

from __future__ import annotations

import random

import pytest
import torch

from support.rl_samples import SEQ_LEN, make_samples
from tandem.config.orchestrator import MAX_REPLAY_KEPT
from tandem.config.trainer import TrainerConfig
from tandem.models import Logprobs, load_model
from tandem.orchestrator.batching import pack_batch
from tandem.trainer.loss import LossInputs, k3, policy_loss
from tandem.trainer.rl import LAG_NAMES, micro_batch_loss
from tandem.transport.batches import KEPT_COUNTS, KEPT_IDS_FLAT, kept_matrix_from_csr

LOSSES = [
    {"type": "ipo"},
    {"type": "icepop", "icepop_low": 0.5, "icepop_high": 1.5},
    {"type": "ppo"},
    {"type": "cispo", "kl_coef": 0.1},
]
CPU = torch.device("cpu")


VERSION = 5
"""The trainer's policy version in these tests; the samples were drawn by versions 0 to 5 (lags 5 to 0)."""


def _samples(seed: int = 0):
    """make_samples with kept ids (some over the replay cap, so off the loss), temperatures other than 1, and
    every policy lag from 0 to 5 (the tokens of one sample are drawn by one or two versions)."""
    rng = random.Random(seed)
    samples = make_samples("token_mean", seed)
    for index, sample in enumerate(samples):
        sample.temperature = (0.7, 1.0, 1.3)[index % 3]
        first = index % (VERSION + 1)
        sample.versions = [min(first + (t > len(sample.versions) // 2), VERSION) for t in range(len(sample.versions))]
        sample.kept_ids = [
            list(range(MAX_REPLAY_KEPT + 1))
            if rng.random() < 0.1
            else []
            if rng.random() < 0.2
            else sorted({token, *rng.sample(range(500), rng.randint(0, 6))})
            for token in sample.completion_ids
        ]
    return samples


def _micros(micro_batch_rows: int = 2):
    return pack_batch(_samples(), SEQ_LEN, world_size=1, micro_batch_rows=micro_batch_rows)[0]


def _run(model_dir, micros, config, version: int = VERSION):
    """Summed loss and metrics over the micro-batches, and the gradients."""
    model = load_model(model_dir, dtype=torch.float32)
    total: dict[str, torch.Tensor] = {}
    for micro in micros:
        loss, metrics = micro_batch_loss(model, micro, config, CPU, current_version=version)
        loss.backward()
        for name, value in {"loss": loss.detach(), **metrics}.items():
            total[name] = total.get(name, 0) + value
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def test_packed_loss_weights_are_zero_wherever_the_target_is_ignored():
    """The loss relies on it: a position whose target is ignored (padding, prompts, kept ids over the replay
    cap) carries weight 0, as the orchestrator packs it."""
    micros = _micros()
    overflow = sum(len(kept) > MAX_REPLAY_KEPT for s in _samples() for kept in s.kept_ids)
    assert overflow, "no token kept more ids than the cap: the test would not cover it"
    off = torch.cat([(m["target_ids"] == -100).flatten() for m in micros])
    weights = torch.cat([m["loss_weights"].flatten() for m in micros])
    assert off.any() and (weights[off] == 0).all()
    assert (weights[~off] > 0).all()


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss["type"])
def test_positions_off_the_loss_add_exactly_nothing(tiny_model_dir, loss):
    """Garbage off the loss (NaN inference logprobs, infinite advantages, weights) changes no bit of the loss,
    its gradients or a metric; the values are those of the loss tokens alone, computed on them only."""
    model_dir = tiny_model_dir("qwen3")
    config = TrainerConfig(loss=loss)
    micros = _micros()
    clean_sums, clean_grads = _run(model_dir, micros, config)
    poisoned = []
    for micro in micros:
        off = micro["target_ids"] == -100
        poisoned.append(
            {
                **micro,
                "inference_logprobs": micro["inference_logprobs"].masked_fill(off, float("nan")),
                "advantages": micro["advantages"].masked_fill(off, float("inf")),
                "loss_weights": micro["loss_weights"].masked_fill(off, 3.0),
            }
        )
    sums, grads = _run(model_dir, poisoned, config)
    assert sums.keys() == clean_sums.keys()
    for name, value in sums.items():
        assert torch.equal(value, clean_sums[name]), name
    for name, value in grads.items():
        assert torch.equal(value, clean_grads[name]), name
    assert all(torch.isfinite(v).all() for v in grads.values())

    # the reference: the same losses over the loss tokens only, picked out by a boolean mask
    model = load_model(model_dir, dtype=torch.float32)
    expected: dict[str, torch.Tensor] = {}
    for micro in micros:
        on = micro["target_ids"] != -100
        kept_matrix = kept_matrix_from_csr(micro[KEPT_COUNTS], micro[KEPT_IDS_FLAT], model.args.vocab_size)
        head = Logprobs(micro["target_ids"], temperature=micro["temperatures"], kept_matrix=kept_matrix)
        out = model(micro["input_ids"], micro["position_ids"], head=head)
        inputs = LossInputs(out.logprobs[on], micro["inference_logprobs"][on], micro["advantages"][on],
                            micro["loss_weights"][on], out.entropy[on])  # fmt: skip
        value, metrics = policy_loss(config.loss, inputs)
        lag = VERSION - micro["versions"][on]
        kl = k3(inputs.logprobs - inputs.inference_logprobs)
        for name, at_lag in zip(LAG_NAMES, [lag == 0, lag == 1, lag == 2, lag >= 3], strict=True):
            metrics[f"{name}_sum"] = (inputs.weights * kl * at_lag).sum()
            metrics[f"{name}_weight"] = (inputs.weights * at_lag).sum()
        metrics["loss_tokens"] = on.sum().float()
        for name, metric in {"loss": value, **metrics}.items():
            expected[name] = expected.get(name, 0) + metric.detach()
    expected["off_policy_kl"] = expected.pop("mismatch_kl")
    assert sums.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(clean_sums[name], value.float(), rtol=1e-5, atol=1e-7, msg=name)
    assert clean_sums["loss_tokens"] == sum(int((m["target_ids"] != -100).sum()) for m in micros)
    # every lag is there, and the lags' weights add up to every loss token's
    assert all(clean_sums[f"{name}_weight"] > 0 for name in LAG_NAMES)
    total = sum(clean_sums[f"{name}_weight"] for name in LAG_NAMES)
    torch.testing.assert_close(total, sum(m["loss_weights"].sum() for m in micros))


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss["type"])
def test_the_fused_loss_equals_the_reference_in_value_metrics_and_gradients(tiny_model_dir, loss):
    """`speed.fused_loss` (the policy loss formed chunk by chunk inside the model's forward) against the chunked
    logprobs and `policy_loss`: per-token temperatures, replayed kept ids, every loss type, fp32."""
    model_dir = tiny_model_dir("qwen3")
    micros = _micros()
    reference = _run(model_dir, micros, TrainerConfig(loss=loss))
    fused = _run(model_dir, micros, TrainerConfig(loss=loss, speed={"fused_loss": True}, loss_chunk_size=48))
    assert fused[0].keys() == reference[0].keys()
    for name, value in reference[0].items():
        torch.testing.assert_close(fused[0][name], value, rtol=1e-5, atol=1e-7, msg=name)
    for name, value in reference[1].items():  # fp32 sums in another order: ~1 ulp of the largest entries (~7)
        torch.testing.assert_close(fused[1][name], value, rtol=1e-5, atol=2e-6, msg=name)
