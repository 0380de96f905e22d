"""`tandem merge-lora` refuses what would write a broken checkpoint or destroy its input, before writing anything:
merged weights that are not finite (an adapter that overflows the output dtype), and an `--out` that is, lies
inside or contains `--base` or `--adapter` (symlinks resolved), `--overwrite` or not."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from support.lora import adapted_model
from tandem.cli import main
from tandem.models.lora import ADAPTER_WEIGHTS, LoraArgs, adapter_state_dict, save_adapter, write_adapter

ARGS = LoraArgs(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))


@pytest.fixture
def inputs(model_dir, tmp_path):
    """A private copy of a tiny base (a refusal that failed would destroy it) and an adapter for it."""
    base = shutil.copytree(model_dir(), tmp_path / "base")
    adapter = save_adapter(adapted_model(base, ARGS, seed=1), tmp_path / "adapter", base_model_name=str(base))
    return base, adapter


def _snapshot(*directories):
    files = (path for directory in directories for path in sorted(directory.rglob("*")))
    return {path: path.read_bytes() for path in files if path.is_file()}


def _merge(base, adapter, out, *extra) -> int:
    return main(["merge-lora", "--base", str(base), "--adapter", str(adapter), "--out", str(out), *extra])


def test_merge_lora_writes_a_finite_checkpoint(inputs, tmp_path):
    base, adapter = inputs
    assert _merge(base, adapter, tmp_path / "merged") == 0
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_merge_lora_refuses_merged_weights_that_are_not_finite(inputs, tmp_path, capsys):
    base, _ = inputs
    # finite fp32 factors whose product (4 * 300 * 300 * alpha / r = 7.2e5) is past fp16's largest value, 65504
    big = {name: torch.full_like(t, 300.0) for name, t in adapter_state_dict(adapted_model(base, ARGS, 1)).items()}
    write_adapter(tmp_path / "big", big, ARGS)
    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "big" / ADAPTER_WEIGHTS).values())
    assert _merge(base, tmp_path / "big", tmp_path / "merged", "--dtype", "float16") == 2
    err = capsys.readouterr().err
    assert "gives NaN or infinite values in layers.0.self_attn.qkv_proj.weight (float16)" in err, err
    assert "nothing written" in err and not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "where",
    ["base", "adapter", "inside-base", "inside-adapter", "parent-of-adapter", "link-to-base", "link-target"],
)
def test_merge_lora_refuses_an_out_that_overlaps_an_input(where, inputs, tmp_path, capsys):
    base, adapter = inputs
    if where == "link-target":  # the base's config.json is a link into another directory, which --out names
        shared = tmp_path / "shared"
        shared.mkdir()
        (base / "config.json").rename(shared / "config.json")
        (base / "config.json").symlink_to(shared / "config.json")
    (tmp_path / "link").symlink_to(base)
    out = {
        "base": base,
        "adapter": adapter,
        "inside-base": base / "merged",
        "inside-adapter": adapter / "merged",
        "parent-of-adapter": tmp_path,
        "link-to-base": tmp_path / "link",
        "link-target": tmp_path / "shared",
    }[where]
    before = _snapshot(base, adapter)
    assert _merge(base, adapter, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "writing the merged checkpoint there would change its input" in err and "Traceback" not in err, err
    assert _snapshot(base, adapter) == before
    assert not (base / "merged").exists() and not (adapter / "merged").exists()
