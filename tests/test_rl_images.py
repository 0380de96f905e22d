"""`tandem rl` on the built-in visual taskset (`count_shapes`) with a tiny Qwen3-VL: the orchestrator sends each
prompt's image inline to the server, batches carry the image references with the expanded prompt, and the trainer
reads the same bytes and scores every token as the engine sampled it (on policy, fp32)."""

from __future__ import annotations

import pytest

from support.jsonl import read_jsonl, read_metrics
from support.runs import two_on_policy_rl_steps
from support.vision_models import write_servable_vl_model

pytest.importorskip("PIL", reason="images need Pillow")


@pytest.mark.slow  # ~25 s on 2 CPU cores; tests/inference/test_vl_engine.py serves images in-process
def test_rl_on_images_stays_on_policy(tmp_path):
    model = write_servable_vl_model(tmp_path / "model")
    two_on_policy_rl_steps(model, tmp_path, "--trainer.optim.lr", "1e-3", taskset="count_shapes")
    run = tmp_path / "rl"
    # the trainer scored every token with the images where the server put them: a missing or shifted image
    # would move the logprobs far more than this
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in read_metrics(run)), read_metrics(run)
    rollouts = read_jsonl(run / "rollouts.jsonl")
    assert rollouts and all(r["source"] == "count_shapes" for r in rollouts)
    # every prompt ran with its 64 x 64 image expanded: 16 x 16 patches of 4 pixels, 2 x 2 merged
    assert all(r["prompt"].count("<|image_pad|>") == 16 * 16 // 4 for r in rollouts)
