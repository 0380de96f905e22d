"""`tandem sft` end to end on CPU: split invariance, FSDP2 over 2 gloo ranks, exact resume after SIGKILL, HF export."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from support.jsonl import read_metrics
from support.runs import final_weights, sft_flags, tandem_command, tandem_sft
from tandem.testing.progress import tree_state, wait_for


@pytest.mark.slow
def test_loss_and_gradients_do_not_depend_on_how_the_batch_is_split(tiny_model_dir, reverse_text_jsonl, tmp_path):
    """1 rank x 1 micro-batch, 1 rank x 2 accumulation steps, 2 FSDP2 ranks, 2 ranks x 2 steps: same numbers."""
    model_dir = tiny_model_dir("qwen3")
    splits = {"1x4": ("1", "4"), "1x2x2": ("1", "2"), "2x2": ("2", "2"), "2x1x2": ("2", "1")}
    runs = {}
    for name, (nproc, micro) in splits.items():
        flags = sft_flags(model_dir, reverse_text_jsonl, tmp_path, name)
        tandem_sft(*flags, "--max-steps", "3", "--deploy.nproc", nproc, "--micro-batch-size", micro)
        runs[name] = tmp_path / name
    reference = read_metrics(runs["1x4"])
    assert len(reference) == 3
    reference_weights = final_weights(runs["1x4"])
    for name, run_dir in runs.items():
        metrics = read_metrics(run_dir)
        for ref, got in zip(reference, metrics, strict=True):
            assert got["loss_tokens"] == ref["loss_tokens"]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), name
        # Three AdamW steps divide by sqrt(v): gradient entries near zero turn fp32 reduction-order noise
        # into differences of ~1e-6 (seen: one entry of 107k at 2.5e-6); real split bugs are ~lr = 3e-3.
        for key, tensor in final_weights(run_dir).items():
            torch.testing.assert_close(tensor, reference_weights[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")


@pytest.mark.slow
def test_resume_after_sigkill_continues_exactly(tiny_model_dir, reverse_text_jsonl, tmp_path):
    model_dir = tiny_model_dir("llama")
    steps = ["--max-steps", "16", "--ckpt.interval", "2", "--ckpt.keep", "2"]
    tandem_sft(*sft_flags(model_dir, reverse_text_jsonl, tmp_path, "straight"), *steps)
    expected = [m["loss"] for m in read_metrics(tmp_path / "straight")]

    flags = [*sft_flags(model_dir, reverse_text_jsonl, tmp_path, "killed"), *steps]
    process = subprocess.Popen(tandem_command("sft", *flags), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "killed" / "checkpoints"
    try:  # as long as the run keeps writing (however slowly), wait for its step-4 checkpoint
        wait_for(
            lambda: (checkpoints / "step-000004").is_dir() or process.poll() is not None,
            lambda: tree_state([tmp_path / "killed"]),
            poll_s=0.02,
        )
    finally:
        assert process.poll() is None, "the run ended before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_before_kill = len(read_metrics(tmp_path / "killed"))
    assert done_before_kill < 16, "killed too late to test anything"

    tandem_sft(*flags, "--resume")
    resumed = read_metrics(tmp_path / "killed")
    assert [m["step"] for m in resumed] == list(range(1, 17))  # every step once, none twice
    assert [m["loss"] for m in resumed] == pytest.approx(expected, rel=1e-6)
    assert len(list(checkpoints.glob("step-*"))) == 2  # keep = 2
    for key, tensor in final_weights(tmp_path / "killed").items():
        torch.testing.assert_close(tensor, final_weights(tmp_path / "straight")[key], rtol=1e-6, atol=1e-7)


def test_resume_without_checkpoint_is_a_clear_error(tiny_model_dir, reverse_text_jsonl, tmp_path):
    flags = sft_flags(tiny_model_dir("qwen3"), reverse_text_jsonl, tmp_path, "fresh")
    result = tandem_sft(*flags, "--resume", check=False)
    assert result.returncode == 2
    assert "nothing to resume" in result.stderr and "Traceback" not in result.stderr
    assert "with `ckpt.interval` = 0 one is written only at the end" in result.stderr  # the setting to change


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hf_export_loads_in_transformers_with_the_trained_weights(tiny_model_dir, reverse_text_jsonl, tmp_path, arch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tandem.models import load_model

    tandem_sft(*sft_flags(tiny_model_dir(arch), reverse_text_jsonl, tmp_path, arch), "--max-steps", "2")
    run_dir = tmp_path / arch
    reference = AutoModelForCausalLM.from_pretrained(run_dir / "hf" / "final", dtype=torch.float32)
    trained = load_model(tiny_model_dir(arch), dtype=torch.float32)  # same shapes; weights replaced below
    master = load_file(
        run_dir / "checkpoints" / "step-000002" / "model-00000-of-00001.safetensors"
    )  # one rank: whole tensors
    trained.load_state_dict(master, strict=True)
    before = load_model(tiny_model_dir(arch), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(trained(ids), expected, rtol=0, atol=1e-4)
        assert not torch.allclose(before(ids), expected, atol=1e-4)  # training changed the model


@pytest.mark.slow
def test_activation_checkpointing_and_compile_do_not_change_the_numbers(tiny_model_dir, reverse_text_jsonl, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    variants = {
        "plain": [],
        "full_ac": ["--activation-checkpointing", "full"],
        "selective_ac": ["--activation-checkpointing", "selective", "--ckpt.interval", "1"],
        "compiled": ["--compile"],
    }
    losses = {}
    for name, flags in variants.items():
        tandem_sft(*sft_flags(model_dir, reverse_text_jsonl, tmp_path, name), "--max-steps", "2", *flags)
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    for name, values in losses.items():
        assert values == pytest.approx(losses["plain"], rel=1e-5), name
