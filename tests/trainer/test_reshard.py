"""Sharded checkpoints: written by 2 ranks with expert parallelism, resumed on 1, 3 and 4 ranks.

Every run must give the per-step losses and final weights of one uninterrupted process: expert parallelism does
not change the numbers, and a checkpoint continues exactly whatever the world size it is loaded on (uneven FSDP
shards on 3 ranks; experts split two ways and replicated on 4). The runs are the SFT trainer's `train()` on
gloo processes forked from a warm server (a torchrun launch each would cost ~5x the time).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from support.dist import run_ranks, train_sft
from support.jsonl import read_metrics
from support.runs import final_weights


def _sft(model_dir, out, run_name, nproc=1, expert_parallel=1, resume=False):
    config = {
        "model": {"name": str(model_dir), "dtype": "float32", "expert_parallel": expert_parallel},
        "data": {"fake": True}, "seq_len": 64, "batch_size": 12, "max_steps": 4, "optim": {"lr": 3e-3},
        "output_dir": str(out), "run_name": run_name, "ckpt": {"interval": 2, "keep": 2}, "resume": {"enabled": resume},
    }  # fmt: skip
    run_ranks(nproc, train_sft, config)


def _assert_same_run(run_dir, reference, name):
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4], name
    for ref, got in zip(read_metrics(reference), metrics, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (name, got["step"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, got["step"])
    expected = final_weights(reference)
    for key, tensor in final_weights(run_dir).items():
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")


@pytest.mark.slow
def test_checkpoint_of_two_expert_parallel_ranks_resumes_on_one_three_and_four(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3_moe")
    _sft(model_dir, tmp_path, "one")
    _sft(model_dir, tmp_path, "ep2", nproc=2, expert_parallel=2)
    _assert_same_run(tmp_path / "ep2", tmp_path / "one", "2 ranks, expert parallel 2")

    saved = tmp_path / "ep2" / "checkpoints" / "step-000002"
    assert json.loads((saved / "state.json").read_text())["world_size"] == 2
    files = sorted(p.name for p in saved.glob("*.safetensors"))
    assert files == [f"{kind}-{r:05d}-of-00002.safetensors" for kind in ("model", "optimizer") for r in (0, 1)]
    for rank in (0, 1):  # each rank wrote its own half of the experts, not a gathered copy
        with safe_open(saved / f"model-{rank:05d}-of-00002.safetensors", "pt") as handle:
            pieces = json.loads(handle.metadata()["tandem.pieces"])
            assert pieces["layers.0.mlp.experts.gate_up_proj"]["offset"][0] == 2 * rank
            assert handle.get_slice("layers.0.mlp.experts.gate_up_proj").get_shape()[0] == 2

    for nproc, expert_parallel in ((1, 1), (3, 1), (4, 2)):
        name = f"resumed-{nproc}x{expert_parallel}"
        (tmp_path / name).mkdir()
        shutil.copytree(saved, tmp_path / name / "checkpoints" / saved.name)
        first_two = (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()[:2]
        (tmp_path / name / "metrics.jsonl").write_text("".join(f"{line}\n" for line in first_two))
        _sft(model_dir, tmp_path, name, nproc, expert_parallel, resume=True)
        _assert_same_run(
            tmp_path / name, tmp_path / "one", f"resumed on {nproc} ranks, expert parallel {expert_parallel}"
        )


def test_a_checkpoint_with_a_missing_rank_file_is_a_clear_error(tiny_model_dir, tmp_path):
    from tandem.trainer.ckpt import CheckpointError, load_checkpoint

    saved = tmp_path / "step-000002"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"step": 2, "world_size": 2}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(saved / "model-00000-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="incomplete: 1 model files, expected 2"):
        load_checkpoint(saved, None, None, None)
