"""A max-perf SFT step never waits for the GPU: any host-device sync after the first step is an error.

GPU only (`speed.sync_debug` is a no-op elsewhere); run it on a CUDA machine with `pytest tests/trainer`.
"""

from __future__ import annotations

import pytest
import torch

from support.jsonl import read_metrics
from support.paths import EXAMPLES
from support.runs import tandem_sft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device syncs exist only with a GPU")


@pytest.mark.parametrize(("arch", "recipe"), [("qwen3", "qwen3-1.7b"), ("qwen3_moe", "qwen3-moe")])
def test_recipe_steps_have_no_host_device_sync(tiny_model_dir, tmp_path, arch, recipe):
    tandem_sft(
        "@", str(EXAMPLES / "advanced" / recipe / "sft-max-perf.toml"), "--model.name", str(tiny_model_dir(arch)),
        "--data.fake", "--seq-len", "256", "--batch-size", "4", "--micro-batch-size", "2", "--max-steps", "3",
        "--speed.sync-debug", "error", "--speed.moe-balanced-routing", "--speed.no-save-final",
        "--output-dir", str(tmp_path), "--run-name", "sync",
    )  # fmt: skip
    assert len(read_metrics(tmp_path / "sync")) == 3
