"""The step loop SFT and the RL trainer share (`trainer/loop.py`): every `speed.*` switch that runs on CPU trains
the RL trainer like the defaults, its hand-off and idle times are recorded, and a diverged loss stops RL as it
stops SFT. The runs are the commands' `train()` in one gloo process forked from a warm server, one after another
(a launch each would cost seconds of imports)."""

from __future__ import annotations

import os
import re

import pytest

from support.dist import run_ranks
from support.jsonl import read_metrics
from support.rl_samples import SEQ_LEN, make_samples
from tandem.orchestrator.batching import pack_batch
from tandem.transport.batches import write_batch

DIVERGED = r"step (\d+): (loss|grad_norm) is (nan|inf|-inf), so training diverged; stopped before saving"


def _train_each(rank: int, world: int, runs: list[tuple[str, dict]]) -> None:
    """Each (command, config) in turn, in process groups of one of their own; a RunError is written to the run's
    error.txt. Runs in the forked process."""
    import torch.distributed as dist

    from tandem.config.sft import SftConfig
    from tandem.config.trainer import TrainerConfig
    from tandem.run import RunError
    from tandem.trainer import rl, sft

    dist.destroy_process_group()
    del os.environ["MASTER_ADDR"]  # init_distributed: a group of one on a store in memory
    for command, config in runs:
        run = (sft.train, SftConfig) if command == "sft" else (rl.train, TrainerConfig)
        try:
            run[0](run[1].model_validate(config))
        except RunError as error:
            (config["output_dir"] / config["run_name"] / "error.txt").write_text(str(error))
            dist.destroy_process_group()


def _rl_run(model_dir, out, name: str, speed: dict, lr: float = 1e-3, steps: int = 2) -> tuple[str, dict]:
    batches = out / name / "batches"
    batches.mkdir(parents=True)
    for step in range(1, steps + 1):
        ranks = pack_batch(make_samples("token_mean", step), SEQ_LEN, world_size=1, micro_batch_rows=2)
        write_batch(batches, step, ranks, {"num_samples": 12, "num_tokens": 100})
    config = {
        "model": {"name": str(model_dir), "dtype": "float32"}, "max_steps": steps, "optim": {"lr": lr},
        "output_dir": out, "run_name": name, "batch_timeout_s": 60, "speed": speed, "log": {"level": "warning"},
    }  # fmt: skip
    return "trainer", config


def test_every_cpu_speed_switch_trains_the_rl_trainer_like_the_defaults(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    variants = {
        "defaults": {},
        "fused-optimizer": {"fused_optimizer": True},
        "plain-module": {"fsdp_single_process": False},
        "fused-loss": {"fused_loss": True},
        "all": {
            "fused_optimizer": True, "fsdp_single_process": False, "fused_loss": True, "sdpa_backends": ["math"],
            "sync_debug": "error", "save_final": False,
        },
    }  # fmt: skip
    run_ranks(1, _train_each, [_rl_run(model_dir, tmp_path, name, speed) for name, speed in variants.items()])
    runs = {name: read_metrics(tmp_path / name) for name in variants}
    reference = runs["defaults"]
    assert [m["step"] for m in reference] == [1, 2]
    for name, metrics in runs.items():
        for ref, got in zip(reference, metrics, strict=True):
            for key in ("loss", "grad_norm", "off_policy_kl", "entropy", "ratio"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-8), f"{name} step {got['step']}: {key}"
            assert got["loss_tokens"] == ref["loss_tokens"]
            # the hand-off's wall time and the wait for the orchestrator, every step
            assert got["publish_s"] > 0 and got["idle_s"] >= 0
        assert (tmp_path / name / "policies" / "step-000002" / "COMPLETE").exists(), "the final policy, always"
    assert (tmp_path / "defaults" / "checkpoints" / "step-000002").is_dir()  # speed.save_final
    assert not list((tmp_path / "all").glob("checkpoints/step-*"))


def test_a_diverged_loss_stops_rl_as_it_stops_sft(tiny_model_dir, tmp_path):
    """Step 1's Adam update moves every weight by ~1e30, so step 2's forward overflows: both commands stop there
    with the same error, before that step's weights are checkpointed, exported or published."""
    model_dir = tiny_model_dir("qwen3")
    sft = {
        "model": {"name": str(model_dir), "dtype": "float32"}, "data": {"fake": True}, "seq_len": 64,
        "batch_size": 2, "max_steps": 4, "optim": {"lr": 1e30}, "ckpt": {"interval": 1, "hf_interval": 1},
        "output_dir": tmp_path, "run_name": "sft", "log": {"level": "warning"},
    }  # fmt: skip
    rl = _rl_run(model_dir, tmp_path, "rl", {}, lr=1e30, steps=4)
    rl[1]["ckpt"] = {"interval": 1, "hf_interval": 1}
    run_ranks(1, _train_each, [("sft", sft), rl])
    stopped = {}
    for name in ("sft", "rl"):
        run_dir = tmp_path / name
        message = (run_dir / "error.txt").read_text()
        match = re.match(DIVERGED, message)
        assert match, message
        step = stopped[name] = int(match.group(1))
        assert 1 < step < 4
        assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, step))
        for folder in ("checkpoints", "hf", "policies"):
            assert not (run_dir / folder / f"step-{step:06d}").exists(), folder
        assert (run_dir / "checkpoints" / f"step-{step - 1:06d}").is_dir()
    assert (tmp_path / "rl" / "policies" / f"step-{stopped['rl'] - 1:06d}" / "COMPLETE").exists()
