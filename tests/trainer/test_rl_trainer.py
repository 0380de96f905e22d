"""The RL trainer on orchestrator-style batch files: exact aggregation however the batch is split."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from support.jsonl import read_metrics
from support.rl_samples import SEQ_LEN, make_samples
from support.runs import run_to_end, tandem_command
from tandem.config.trainer import TrainerConfig
from tandem.models import Logprobs, load_model
from tandem.orchestrator.batching import pack_batch
from tandem.trainer.rl import micro_batch_loss
from tandem.transport.batches import KEPT_COUNTS, KEPT_IDS_FLAT, read_batch, write_batch
from tandem.transport.policies import COMPLETE


def gradients(model_dir, micros, config) -> dict[str, torch.Tensor]:
    model = load_model(model_dir, dtype=torch.float32)
    for micro in micros:
        loss, _ = micro_batch_loss(model, micro, config, torch.device("cpu"), current_version=0)
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token_mean", "prompt_mean"])
def test_gradients_identical_for_one_or_two_micro_batches_and_two_ranks(tiny_model_dir, aggregation):
    model_dir = tiny_model_dir("qwen3")
    config = TrainerConfig()
    samples = make_samples(aggregation)
    whole = pack_batch(samples, SEQ_LEN, world_size=1, micro_batch_rows=16)
    assert len(whole[0]) == 1
    split = pack_batch(samples, SEQ_LEN, world_size=1, micro_batch_rows=1)
    assert len(split[0]) > 1
    two_ranks = pack_batch(samples, SEQ_LEN, world_size=2, micro_batch_rows=1)
    reference = gradients(model_dir, whole[0], config)
    rank0, rank1 = (gradients(model_dir, micros, config) for micros in two_ranks)
    candidates = {
        "micro-batches": gradients(model_dir, split[0], config),
        # Two ranks' gradients add up (FSDP averages them and the trainer scales by world size).
        "ranks": {key: rank0[key] + rank1[key] for key in rank0},
    }
    for name, grads in candidates.items():
        for key, value in reference.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_prompt_mean_weighs_every_prompt_the_same():
    samples = make_samples("prompt_mean")
    per_prompt: dict[tuple, float] = {}
    for sample in samples:
        key = tuple(sample.prompt_ids)
        per_prompt[key] = per_prompt.get(key, 0.0) + sample.weight * len(sample.completion_ids)
    assert list(per_prompt.values()) == pytest.approx([1 / 3] * 3)
    token_mean = make_samples("token_mean")
    assert sum(s.weight * len(s.completion_ids) for s in token_mean) == pytest.approx(1.0)


def test_batch_file_round_trip(tmp_path):
    ranks = pack_batch(make_samples("token_mean"), SEQ_LEN, world_size=2, micro_batch_rows=2)
    write_batch(tmp_path, 1, ranks, {"num_samples": 12})
    for rank in range(2):
        micros, header = read_batch(tmp_path, 1, rank, 2)
        assert header["num_samples"] == 12 and header["world_size"] == 2
        for got, want in zip(micros, ranks[rank], strict=True):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(ValueError, match="packed for 2 trainer ranks"):
        read_batch(tmp_path, 1, 0, 1)
    assert not list(tmp_path.glob(".*.tmp"))


def run_trainer(model_dir, out, name, nproc, batches):
    run_dir = out / name
    (run_dir / "batches").mkdir(parents=True)
    for step, ranks in enumerate(batches, start=1):
        write_batch(run_dir / "batches", step, ranks, {"num_samples": 12, "num_tokens": 100})
    flags = [
        "--model", str(model_dir), "--model.dtype", "float32", "--max-steps", str(len(batches)),
        "--output-dir", str(out), "--run-name", name, "--optim.lr", "1e-3", "--batch-timeout-s", "60",
    ]  # fmt: skip
    if nproc == 1:
        command = tandem_command("trainer", *flags)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += ["-m", "tandem.trainer.rl", *flags]
    run_to_end(command, watch=[run_dir])  # torchrun's ranks die with it if it stalls
    return run_dir


@pytest.mark.slow
def test_trainer_on_two_gloo_ranks_matches_one_and_publishes_policies(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    model_dir = tiny_model_dir("qwen3")
    steps = [make_samples("token_mean", seed) for seed in (1, 2)]
    one = run_trainer(model_dir, tmp_path, "one", 1, [pack_batch(s, SEQ_LEN, 1, 1) for s in steps])
    two = run_trainer(model_dir, tmp_path, "two", 2, [pack_batch(s, SEQ_LEN, 2, 1) for s in steps])
    metrics = [read_metrics(run) for run in (one, two)]
    for a, b in zip(*metrics, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["off_policy_kl"] == pytest.approx(b["off_policy_kl"], rel=1e-5)
        if a["step"] == 1:  # step 1's samples came from version 0, the trainer's weights then
            assert a["mismatch_kl"] == pytest.approx(b["mismatch_kl"], rel=1e-5, abs=1e-9)
        else:  # no token of step 2 came from version 1: no mismatch to measure (newer pytest rejects approx(None))
            assert a["mismatch_kl"] is None and b["mismatch_kl"] is None
    for step in (1, 2):
        policy = one / "policies" / f"step-{step:06d}"
        assert (policy / COMPLETE).exists() and (policy / "config.json").exists()
    final = [load_file(run / "policies" / "step-000002" / "model.safetensors") for run in (one, two)]
    for key in final[0]:
        torch.testing.assert_close(final[0][key], final[1][key], rtol=0, atol=1e-5)


def test_csr_kept_ids_give_the_loss_of_the_kept_matrix(tiny_model_dir):
    """The trainer rebuilds the padded kept matrix from the batch's CSR kept ids: the loss and its gradients are
    those of the model given that matrix directly (micro-batches of two rows: the flat ids span rows)."""
    from tandem.trainer.loss import LossInputs, policy_loss

    rng = random.Random(3)
    samples = make_samples("token_mean")
    for sample in samples:  # each completion token sampled from a few kept ids holding it (or the whole vocab)
        sample.kept_ids = [
            [] if rng.random() < 0.2 else sorted({token, *rng.sample(range(500), rng.randint(0, 6))})
            for token in sample.completion_ids
        ]
    config = TrainerConfig()
    micros = pack_batch(samples, SEQ_LEN, world_size=1, micro_batch_rows=2)[0]
    compact = gradients(tiny_model_dir("qwen3"), micros, config)
    model = load_model(tiny_model_dir("qwen3"), dtype=torch.float32)
    for micro in micros:
        width = max(len(kept) for s in samples for kept in s.kept_ids)
        padded = torch.full((*micro["target_ids"].shape, width), -1, dtype=torch.long)
        flat, start = micro[KEPT_IDS_FLAT].tolist(), 0
        for index, count in enumerate(micro[KEPT_COUNTS].flatten().tolist()):
            padded.view(-1, width)[index, :count] = torch.tensor(flat[start : start + count])
            start += count
        on = micro["target_ids"] != -100
        head = Logprobs(micro["target_ids"], temperature=micro["temperatures"], kept_matrix=padded)
        out = model(micro["input_ids"], micro["position_ids"], head=head)
        inputs = LossInputs(out.logprobs[on], micro["inference_logprobs"][on], micro["advantages"][on],
                            micro["loss_weights"][on])  # fmt: skip
        policy_loss(config.loss, inputs)[0].backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(compact[name], parameter.grad, rtol=1e-5, atol=1e-7, msg=name)
