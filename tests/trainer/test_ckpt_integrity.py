"""Training checkpoints are verified against their manifest (sizes, CRC-32) before a resume, a damaged newest one
falls back to the newest intact one (logged, naming the file), and an interrupted save or clean-up leaves no
partial `step-<N>` behind and nothing at all after the next start."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from support.dist import run_ranks, train_sft
from support.jsonl import read_metrics
from tandem.trainer import ckpt
from tandem.trainer.ckpt import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    resume_step,
    save_checkpoint,
    verify_checkpoint,
)


def _trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> None:
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


@pytest.fixture
def root(tmp_path) -> Path:
    """Checkpoints of steps 1, 2 and 3 (keep = 3) of a small model."""
    model, optimizer, scheduler = _trainer()
    for step in (1, 2, 3):
        _train_step(model, optimizer, scheduler)
        save_checkpoint(tmp_path / "checkpoints", step, model, optimizer, scheduler, keep=3)
    return tmp_path / "checkpoints"


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset % len(data)] ^= 0x01
    file.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_checksum(root):
    newest = root / "step-000003"
    manifest = json.loads((newest / MANIFEST).read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in newest.iterdir() if p.name != MANIFEST)
    for name, entry in manifest.items():
        assert entry == {"bytes": (newest / name).stat().st_size, "crc32": ckpt.file_crc32(newest / name)}
    verify_checkpoint(newest)


DAMAGE = {
    "a flipped byte in the weights": ("model-00000-of-00001.safetensors", lambda f: _flip_byte(f, -7), "CRC-32"),
    "a flipped byte in the optimizer": ("optimizer-00000-of-00001.safetensors", lambda f: _flip_byte(f, -3), "CRC-32"),
    "a flipped byte in state.json": ("state.json", lambda f: _flip_byte(f, 40), "CRC-32"),
    "a truncated file": ("model-00000-of-00001.safetensors", lambda f: f.write_bytes(f.read_bytes()[:-9]), "bytes"),
    "a missing file": ("optimizer-00000-of-00001.safetensors", Path.unlink, "missing"),
    "a corrupt manifest": (MANIFEST, lambda f: f.write_text('{"files": {'), "manifest"),
    "a missing manifest": (MANIFEST, Path.unlink, "missing"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(case, root, caplog):
    name, damage, problem = DAMAGE[case]
    file = root / "step-000003" / name
    damage(file)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}.*{problem}|{problem}.*{re.escape(str(file))}"):
        verify_checkpoint(root / "step-000003")
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        resolve_resume(root, 3, interval=("ckpt.interval", 1))  # asked for by step: no fallback
    with caplog.at_level(logging.WARNING, logger="tandem.trainer.ckpt"):
        assert resolve_resume(root, None, interval=("ckpt.interval", 1)) == (2, root / "step-000002")
    assert str(file) in caplog.text and "resuming from step 2" in caplog.text


def test_every_checkpoint_damaged_is_an_error_naming_each(root):
    for step in (1, 2, 3):
        _flip_byte(root / f"step-{step:06d}" / "model-00000-of-00001.safetensors", -5)
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged") as error:
        resolve_resume(root, None, interval=("ckpt.interval", 1))
    assert all(f"step-{step:06d}/model-00000-of-00001.safetensors" in str(error.value) for step in (1, 2, 3))


def test_the_fallback_restores_that_checkpoint_exactly(root, tmp_path):
    """Resuming after the newest is damaged continues exactly as from step 2 itself."""
    reference = tmp_path / "reference"
    shutil.copytree(root / "step-000002", reference)
    _flip_byte(root / "step-000003" / "model-00000-of-00001.safetensors", -11)
    config = SimpleNamespace(
        run_dir=root.parent, resume=SimpleNamespace(enabled=True, step=None), ckpt=SimpleNamespace(interval=1)
    )
    resumed, expected = _trainer(seed=1), _trainer(seed=2)
    assert resume_step(config, *resumed) == 2
    _train_step(*resumed)  # the RNG state is restored too, so the next batch is the same
    load_checkpoint(reference, *expected)
    _train_step(*expected)
    for (name, got), (_, want) in zip(resumed[0].state_dict().items(), expected[0].state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    assert resumed[2].state_dict() == expected[2].state_dict()


def test_an_interrupted_clean_up_leaves_no_partial_checkpoint(root, monkeypatch):
    """Pruning renames a checkpoint to a hidden trash name before deleting it: a kill mid-deletion leaves trash
    that no listing sees and the next start removes, never a `step-<N>` with some of its files."""
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        if not (Path(path) / "state.json").exists():  # not a checkpoint (the save's fresh temporary directory)
            return real_rmtree(path, ignore_errors=ignore_errors)
        next(Path(path).glob("optimizer-*")).unlink()  # part of the checkpoint is gone...
        raise KeyboardInterrupt  # ...when the process is killed

    model, optimizer, scheduler = _trainer()
    _train_step(model, optimizer, scheduler)
    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, model, optimizer, scheduler, keep=3)  # prunes step 1
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert sorted(list_checkpoints(root)) == [2, 3, 4]
    leftovers = [p for p in root.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and "step-000001" in leftovers[0].name
    (root / "step-000009.tmp").mkdir()  # and a save killed before its rename
    (root / "step-000009.tmp" / "model-00000-of-00001.safetensors").write_bytes(b"half")
    config = SimpleNamespace(run_dir=root.parent, resume=SimpleNamespace(enabled=False, step=None))
    assert resume_step(config, model, optimizer, scheduler) == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003", "step-000004"]


def test_unparsable_files_are_named_when_loading(root):
    state = root / "step-000003" / "state.json"
    state.write_text("{")
    with pytest.raises(CheckpointError, match=re.escape(f"{state} is not valid JSON")):
        load_checkpoint(root / "step-000003", *_trainer())
    weights = root / "step-000002" / "model-00000-of-00001.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(f"{weights} is not readable safetensors")):
        load_checkpoint(root / "step-000002", *_trainer())
    whole = root / "step-000001" / "model-00000-of-00001.safetensors"
    save_file(_trainer()[0].state_dict(), str(whole))  # whole tensors, no metadata placing them
    with pytest.raises(CheckpointError, match=re.escape(f"{whole} does not place 0.")):
        load_checkpoint(root / "step-000001", *_trainer())


def _verify_on_rank(rank: int, world: int, path: str, damaged: str) -> None:
    with pytest.raises(CheckpointError, match=re.escape(f"{damaged} fails its CRC-32 checksum")):
        verify_checkpoint(Path(path))


def test_ranks_split_the_checksums_and_all_name_the_damaged_file(root):
    """Under torch.distributed each rank checksums every W-th file; the one that finds the damage tells all."""
    newest = root / "step-000003"
    names = sorted(json.loads((newest / MANIFEST).read_text())["files"])
    damaged = newest / names[-1]  # checked by rank (len(names) - 1) % 2 only
    _flip_byte(damaged, 3)
    run_ranks(2, _verify_on_rank, str(newest), str(damaged))


def test_rl_resume_takes_the_newest_intact_checkpoint_and_drops_what_came_after(root, caplog):
    """`tandem rl --resume` picks the trainer checkpoint in the launcher: a damaged step 3 means step 2, and the
    batch and policy of step 3 go, so they are produced again."""
    from tandem.launch import _resume_step
    from tandem.transport.batches import batch_path
    from tandem.transport.policies import policy_dir

    run_dir = root.parent
    for step in (2, 3):
        batch_path(run_dir / "batches", step).parent.mkdir(exist_ok=True)
        batch_path(run_dir / "batches", step).write_bytes(b"batch")
        policy_dir(run_dir / "policies", step).mkdir(parents=True)
    _flip_byte(root / "step-000003" / "state.json", 10)
    resume = SimpleNamespace(enabled=True, step=None)
    trainer = SimpleNamespace(ckpt=SimpleNamespace(interval=1))
    config = SimpleNamespace(run_dir=run_dir, max_steps=5, resume=resume, trainer=trainer)
    with caplog.at_level(logging.WARNING, logger="tandem.trainer.ckpt"):
        assert _resume_step(config) == 2
    assert "step-000003/state.json fails its CRC-32 checksum" in caplog.text
    assert batch_path(run_dir / "batches", 2).exists() and not batch_path(run_dir / "batches", 3).exists()
    assert policy_dir(run_dir / "policies", 2).exists() and not policy_dir(run_dir / "policies", 3).exists()


@pytest.mark.slow
def test_sft_resume_past_a_damaged_newest_checkpoint_continues_exactly(tiny_model_dir, tmp_path):
    """The SFT trainer resuming after its newest checkpoint lost a byte: it logs which file, resumes from the one
    before, and the steps it trains again give the same losses as the first time."""
    config = {
        "model": {"name": str(tiny_model_dir("qwen3")), "dtype": "float32"}, "data": {"fake": True},
        "seq_len": 64, "batch_size": 4, "max_steps": 4, "optim": {"lr": 3e-3}, "output_dir": str(tmp_path),
        "run_name": "run", "ckpt": {"interval": 2, "keep": 2},
    }  # fmt: skip
    run_ranks(1, train_sft, config)
    first = read_metrics(tmp_path / "run")
    damaged = tmp_path / "run" / "checkpoints" / "step-000004" / "model-00000-of-00001.safetensors"
    _flip_byte(damaged, -100)
    run_ranks(1, train_sft, {**config, "resume": {"enabled": True}})
    log = (tmp_path / "run" / "logs" / "sft.log").read_text()
    assert f"{damaged} fails its CRC-32 checksum" in log and "resuming from step 2" in log
    resumed = read_metrics(tmp_path / "run")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert [m.get("resumed_from") for m in resumed] == [None, None, 2, None]  # where the dashboard marks it
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first]
    verify_checkpoint(tmp_path / "run" / "checkpoints" / "step-000004")  # written again, whole


def test_a_resume_removes_the_checkpoints_past_it_so_keep_spares_its_own(root):
    """Resuming from step 1 drops steps 2 and 3 (an abandoned history): with keep = 1 the resumed run's next
    checkpoint is the one kept, not deleted in favour of the old step 3, and a later resume takes it."""
    config = SimpleNamespace(
        run_dir=root.parent, resume=SimpleNamespace(enabled=True, step=1), ckpt=SimpleNamespace(interval=1)
    )
    model, optimizer, scheduler = _trainer(seed=1)
    assert resume_step(config, model, optimizer, scheduler) == 1
    assert sorted(list_checkpoints(root)) == [1]
    _train_step(model, optimizer, scheduler)
    save_checkpoint(root, 2, model, optimizer, scheduler, keep=1)
    assert sorted(list_checkpoints(root)) == [2]
    config.resume.step = None
    assert resume_step(config, *_trainer(seed=2)) == 2
