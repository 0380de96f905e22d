"""One process without FSDP2 (`speed.fsdp_single_process = false`): the same training as with it."""

from __future__ import annotations

import pytest
import torch

from support.jsonl import read_metrics
from support.runs import final_weights, sft_flags, tandem_sft

pytestmark = pytest.mark.slow


def test_a_plain_module_trains_like_fsdp2(tiny_model_dir, reverse_text_jsonl, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    runs = {}
    for name, flags in {
        "fsdp": [],
        "plain": ["--speed.no-fsdp-single-process"],
        "plain-bf16": ["--speed.no-fsdp-single-process", "--model.dtype", "bfloat16"],
    }.items():
        tandem_sft(*sft_flags(model_dir, reverse_text_jsonl, tmp_path, name), "--max-steps", "3", *flags)
        runs[name] = read_metrics(tmp_path / name)
    for ref, got in zip(runs["fsdp"], runs["plain"], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    fsdp, plain = final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "plain")
    for key, tensor in plain.items():
        torch.testing.assert_close(tensor, fsdp[key], rtol=0, atol=1e-6, msg=key)
    # bf16 under autocast: matmuls round (the loss moves), the run still trains like the fp32 one
    losses = [m["loss"] for m in runs["plain-bf16"]]
    assert losses != [m["loss"] for m in runs["plain"]]
    assert losses == pytest.approx([m["loss"] for m in runs["plain"]], rel=3e-2)
