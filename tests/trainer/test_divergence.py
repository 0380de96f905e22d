"""A loss or gradient norm that stops being finite ends the run at that step, before its weights are saved."""

from __future__ import annotations

import re

import pytest
import torch

from support.jsonl import read_metrics
from support.runs import tandem_sft
from tandem.run import RunError
from tandem.trainer.monitor import stop_if_diverged
from tandem.trainer.parallel import World

ONE = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_finite_values_pass_and_the_first_non_finite_one_names_the_step():
    stop_if_diverged(3, ONE, loss=torch.tensor(2.5), grad_norm=torch.tensor(1e30))
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(RunError, match=rf"step 7: loss is {bad}"):
            stop_if_diverged(7, ONE, loss=torch.tensor(bad), grad_norm=torch.tensor(1.0))
    with pytest.raises(RunError, match=r"step 2: grad_norm is nan, so training diverged"):
        stop_if_diverged(2, ONE, loss=torch.tensor(1.0), grad_norm=torch.tensor(float("nan")))


def test_sft_whose_loss_goes_nan_exits_1_naming_the_step_and_exports_nothing(
    tiny_model_dir, reverse_text_jsonl, tmp_path
):
    run_dir = tmp_path / "diverged"
    flags = [
        "--model", str(tiny_model_dir("qwen3")), "--model.dtype", "float32", "--data.path", str(reverse_text_jsonl),
        "--seq-len", "256", "--batch-size", "2", "--output-dir", str(tmp_path), "--run-name", "diverged",
        # Step 1's Adam update moves every weight by ~1e30, so step 2's forward overflows.
        "--optim.lr", "1e30", "--max-steps", "6", "--ckpt.interval", "1", "--ckpt.hf-interval", "1",
    ]  # fmt: skip
    result = tandem_sft(*flags, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    stopped = re.search(r"step (\d+): (loss|grad_norm) is (nan|inf|-inf)", result.stderr)
    assert stopped, result.stderr[-3000:]
    step = int(stopped.group(1))
    assert step < 6
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, step))
    assert not (run_dir / "hf" / "final").exists()
    assert not (run_dir / "hf" / f"step-{step:06d}").exists()
    assert not (run_dir / "checkpoints" / f"step-{step:06d}").exists()
    assert not (run_dir / "checkpoints" / "step-000006").exists()


def test_the_rl_trainer_entry_point_reports_a_mistake_in_one_line(capsys):
    from tandem.trainer.rl import main as rl_trainer_main

    assert rl_trainer_main(["--optim.lr", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem trainer: error: invalid value for `optim.lr`") and "Traceback" not in err
