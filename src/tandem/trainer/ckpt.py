"""Full training checkpoints: model, optimizer, scheduler, data position and RNG, resumable exactly, on any world size.

Layout of `<run>/checkpoints/step-<N>/`, written by W ranks:

- `model-<r>-of-<W>.safetensors`: the fp32 master weights rank r holds (its FSDP2 shard of each tensor, its
  experts under expert parallelism; rank 0 also what every rank holds whole). With LoRA (`[model.lora]`) only
  the adapters: the frozen base is `model.name` and is loaded from there again on resume. The file's metadata
  `tandem.pieces` says where each of them sits: `{name: {"shape": whole shape, "offset": [start per dim]}}`.
- `optimizer-<r>-of-<W>.safetensors`: the AdamW moments, keyed `<parameter>::<state>`, sharded the same way.
- `state.json`: step, world size, scheduler, optimizer param groups, RNG, anything else the loop needs.
- `manifest.json`, written last: the size and CRC-32 of every other file, so a damaged file (truncated, zeroed
  by a crash, one flipped byte) is found before anything is loaded.

Every rank writes its own files (the run directory is shared, as batches and policies are), nothing is gathered,
and no rank ever holds a whole tensor it does not own. Loading on another world size or expert-parallel degree
reads, for each tensor a rank holds now, the overlapping part of every saved piece (safetensors reads slices
lazily), so checkpoints reshard on load. Tensors go through safetensors and the rest through JSON: loading never
unpickles. Ranks write into `step-<N>.tmp/` and rank 0 renames it once all are done, so a directory named
`step-<N>` is always whole. A directory is removed by renaming it to a hidden `.trash-*` name first, so an
interrupted clean-up never leaves a partial `step-<N>`; the next start removes what an interrupted save or
clean-up left. Resuming verifies the newest checkpoint against its manifest (the ranks split the work) and falls
back to the newest intact one, saying which file was damaged; the checkpoints past the one resumed from are
removed (a history the resumed run replaces).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tandem.checkpoints import checkpoint_dir, checkpoints_root, list_checkpoints
from tandem.config.errors import ConfigError
from tandem.files import atomic_write_text
from tandem.models.lora import is_adapter_name, lora_args
from tandem.trainer.expert_parallel import Piece, expert_params, expert_piece

logger = logging.getLogger(__name__)

_SAVING_DIR = re.compile(r"^step-(\d+)\.tmp$")
_TRASH = ".trash-"
MANIFEST = "manifest.json"
_CHUNK_BYTES = 16 << 20
_PIECES_KEY = "tandem.pieces"
_SHARDED = StateDictOptions(full_state_dict=False)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ConfigError):
    """A checkpoint that is missing or unusable; the message names the directory."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same count on each rank), on every rank; integers only, so nothing is pickled."""
    if _world_size() == 1:
        return [values]
    mine = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(mine) for _ in range(_world_size())]
    dist.all_gather(gathered, mine)
    return [t.tolist() for t in gathered]


def _min_over_ranks(value: int) -> int:
    if _world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


# --- integrity: a manifest of sizes and checksums, directories removed without leaving parts ---


def file_crc32(path: Path) -> int:
    """The CRC-32 of a file, read in chunks.

    CRC-32 because the threat is accidental damage (a truncated or zero-filled write after a crash, a flipped
    byte on disk), not tampering: it catches every error burst of up to 32 bits, and zlib's computes it at
    about 2.7 GB/s on one core, against 1.5 GB/s for sha256 and 0.7 GB/s for blake2b, so checking a checkpoint
    costs little more than reading it.
    """
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _discard(path: Path) -> None:
    """Delete a directory so that no reader ever sees part of it: one atomic rename to a hidden trash name,
    then the deletion (a kill in between leaves only the trash, which `remove_leftovers` clears)."""
    if not path.exists():
        return
    trash = path.with_name(f"{_TRASH}{path.name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Delete what an interrupted save (`step-<N>.tmp/`) or clean-up (`.trash-*`) left under `root`."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(_TRASH) or _SAVING_DIR.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by an interrupted checkpoint save or clean-up", path)


def _read_manifest(path: Path) -> dict[str, dict[str, int]]:
    """File name -> {"bytes", "crc32"} from `path`'s manifest."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {path} is damaged: {manifest} is missing")
    try:
        files = json.loads(manifest.read_bytes())["files"]
        return {str(name): {"bytes": int(e["bytes"]), "crc32": int(e["crc32"])} for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"checkpoint manifest {manifest} is unreadable ({type(error).__name__}: {error})"
        ) from None


def verify_checkpoint(path: Path) -> None:
    """CheckpointError naming the first file of checkpoint `path` that is missing, has the wrong size or fails its
    checksum. Collective when distributed: every rank checks the sizes, rank r the checksums of every W-th file."""
    manifest = _read_manifest(path)
    names = sorted(manifest)
    for name in names:
        file, expected = path / name, manifest[name]["bytes"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {file} is missing")
        if file.stat().st_size != expected:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {file} has {file.stat().st_size} bytes, the manifest says {expected}"
            )
    rank, world = _rank(), _world_size()
    mine = (i for i in range(rank, len(names), world) if file_crc32(path / names[i]) != manifest[names[i]]["crc32"])
    first_bad = _min_over_ranks(next(mine, len(names)))
    if first_bad < len(names):
        raise CheckpointError(f"checkpoint {path} is damaged: {path / names[first_bad]} fails its CRC-32 checksum")


def _rng_state() -> dict[str, list[int]]:
    state = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, list[int]]) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# --- where each local tensor sits in the whole one ---


def _dtensor_piece(value: DTensor) -> Piece:
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    coordinate = value.device_mesh.get_coordinate() or []
    # Of the ranks that hold the same values (replicated mesh dims), the first writes them.
    writer = all(c == 0 for c, p in zip(coordinate, value.placements, strict=True) if isinstance(p, Replicate))
    return Piece(tuple(value.shape), tuple(offset), writer)


class _Layout:
    """Where each of this rank's tensors sits in the whole one, for the tensors of a model or of its optimizer.

    Optimizer keys are `<parameter>::<state>`; a state with its parameter's shape is sharded like it, any other
    (AdamW's `step`) is held whole by every rank and written by rank 0."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = get_model_state_dict(model, options=_SHARDED)
        if lora_args(model) is not None:  # the frozen base is reloaded from model.name: only adapters are saved
            self.params = {name: value for name, value in self.params.items() if is_adapter_name(name)}
        self.experts = expert_params(model)

    def like(self, name: str) -> Any:
        """The parameter (a DTensor, or a plain tensor) that tensor `name` belongs to, or None."""
        return self.params.get(name.rsplit("::", 1)[0])

    def piece(self, name: str, value: torch.Tensor) -> tuple[torch.Tensor, Piece]:
        """(this rank's local tensor, its piece) for `value`, a DTensor or the local tensor itself."""
        if isinstance(value, DTensor):
            return value.to_local(), _dtensor_piece(value)
        param_name, like = name.rsplit("::", 1)[0], self.like(name)
        if param_name in self.experts and like is not None and value.shape == like.shape:
            return value, expert_piece(value, self.experts[param_name][1])
        return value, Piece(tuple(value.shape), (0,) * value.dim(), _rank() == 0)


def _write_pieces(path: Path, state: dict[str, Any], layout: _Layout) -> list[int]:
    """Write this rank's pieces of `state` to `path`; returns [size in bytes, CRC-32] of the file."""
    tensors, pieces = {}, {}
    for name, value in state.items():
        local, piece = layout.piece(name, value)
        if piece.writer and local.numel():
            tensors[name] = local.detach().contiguous().cpu()
            pieces[name] = {"shape": list(piece.global_shape), "offset": list(piece.offset)}
    save_file(tensors, str(path), metadata={_PIECES_KEY: json.dumps(pieces)})
    return [path.stat().st_size, file_crc32(path)]  # just written: read back from the page cache


class _SavedPieces:
    """Every saved piece of every tensor in a set of safetensors files, read back region by region."""

    def __init__(self, files: list[Path]) -> None:
        self.pieces: dict[str, list[tuple[Path, tuple[int, ...], tuple[int, ...]]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._open: dict[Path, Any] = {}
        for file in files:
            handle = self._handle(file)
            meta = json.loads((handle.metadata() or {}).get(_PIECES_KEY, "{}"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name not in meta:
                    raise CheckpointError(f"checkpoint file {file} does not place {name} ({_PIECES_KEY} metadata)")
                tensor = handle.get_slice(name)
                local = tuple(tensor.get_shape())
                whole = meta[name]
                self.shapes[name] = tuple(whole["shape"])
                self.dtypes[name] = _DTYPES[tensor.get_dtype()]
                self.pieces.setdefault(name, []).append((file, tuple(whole["offset"]), local))

    def _handle(self, file: Path):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), "pt")
            except Exception as error:  # SafetensorError has no importable base besides Exception
                raise CheckpointError(f"checkpoint file {file} is not readable safetensors: {error}") from None
        return self._open[file]

    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region `[offset, offset + shape)` of tensor `name`, assembled from the pieces that overlap it."""
        out = torch.empty(shape, dtype=self.dtypes[name])
        filled = 0
        for file, start, size in self.pieces[name]:
            low = [max(a, b) for a, b in zip(offset, start, strict=True)]
            high = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, start, size, strict=True)]
            if any(h <= lo for lo, h in zip(low, high, strict=True)):
                continue
            source = tuple(slice(lo - s, h - s) for lo, h, s in zip(low, high, start, strict=True))
            target = tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, offset, strict=True))
            handle = self._handle(file)
            out[target] = handle.get_slice(name)[source] if source else handle.get_tensor(name)
            filled += math.prod(h - lo for lo, h in zip(low, high, strict=True))
        if filled != out.numel():
            raise CheckpointError(
                f"the saved pieces of {name} cover {filled} of the {out.numel()} values this rank needs"
            )
        return out


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    tensors, scalars = {}, {}
    for name, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}::{key}"] = value
            else:
                scalars[f"{name}::{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep: int,
) -> Path:
    """Write step-<step>/ atomically (every rank its own shards, each checksumming what it wrote, then rank 0 the
    state and the manifest) and keep only the newest `keep` checkpoints."""
    rank, world = _rank(), _world_size()
    final = checkpoint_dir(root, step)
    tmp = final.with_name(f"{final.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    optim_tensors, optim_meta = _flatten_optimizer(get_optimizer_state_dict(model, optimizer, options=_SHARDED))
    layout = _Layout(model)
    sums = [
        *_write_pieces(tmp / _rank_file("model", rank, world), layout.params, layout),
        *_write_pieces(tmp / _rank_file("optimizer", rank, world), optim_tensors, layout),
    ]
    every_rank = _all_gather_ints(sums)  # also the barrier: every rank's files are written
    if rank == 0:
        state = {
            "step": step,
            "world_size": world,
            "scheduler": scheduler.state_dict(),
            "optimizer": optim_meta,
            "rng": _rng_state(),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        files = {"state.json": [(tmp / "state.json").stat().st_size, file_crc32(tmp / "state.json")]}
        for r, (model_bytes, model_crc, optim_bytes, optim_crc) in enumerate(every_rank):
            files[_rank_file("model", r, world)] = [model_bytes, model_crc]
            files[_rank_file("optimizer", r, world)] = [optim_bytes, optim_crc]
        manifest = {name: {"bytes": size, "crc32": crc} for name, (size, crc) in sorted(files.items())}
        atomic_write_text(tmp / MANIFEST, json.dumps({"files": manifest}, indent=1))
        _discard(final)
        tmp.rename(final)
        for old_step, path in list(list_checkpoints(root).items())[:-keep]:
            _discard(path)
            logger.debug("removed old checkpoint %s (step %d)", path, old_step)
        logger.info("saved checkpoint %s (%d ranks)", final, world)
    _barrier()
    return final


def _rank_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-{rank:05d}-of-{world:05d}.safetensors"


def _files(path: Path, kind: str, world: int) -> list[Path]:
    files = sorted(path.glob(f"{kind}-*.safetensors"))
    if len(files) != world:
        raise CheckpointError(f"checkpoint {path} is incomplete: {len(files)} {kind} files, expected {world}")
    return files


def _check_names(path: Path, kind: str, saved: _SavedPieces, wanted: set[str]) -> None:
    missing, unexpected = sorted(wanted - set(saved.shapes)), sorted(set(saved.shapes) - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match this model's {kind}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


@torch.no_grad()
def _load_model(path: Path, layout: _Layout, saved: _SavedPieces) -> None:
    _check_names(path, "weights", saved, set(layout.params))
    for name, value in layout.params.items():
        local, piece = layout.piece(name, value)
        if saved.shapes[name] != piece.global_shape:
            raise CheckpointError(
                f"checkpoint {path}: {name} has shape {saved.shapes[name]}, the model {piece.global_shape}"
            )
        local.copy_(saved.read(name, piece.offset, tuple(local.shape)))


def _load_optimizer(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: _Layout,
    saved: _SavedPieces,
    meta: dict,
) -> None:
    tensors: dict[str, Any] = {}
    for name, shape in saved.shapes.items():
        like = layout.like(name)
        if like is None:
            raise CheckpointError(f"checkpoint {path}: optimizer state {name} belongs to no parameter of this model")
        local, piece = layout.piece(name.rsplit("::", 1)[0], like)
        if shape == piece.global_shape and like.dim():  # sharded like its parameter: read this rank's part
            part = saved.read(name, piece.offset, tuple(local.shape)).to(local.device)
            is_dtensor = isinstance(like, DTensor)
            tensors[name] = (
                DTensor.from_local(part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
                if is_dtensor
                else part
            )
        else:
            tensors[name] = saved.read(name, (0,) * len(shape), shape)
    state: dict[str, dict[str, Any]] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        name, key = flat.rsplit("::", 1)
        state.setdefault(name, {})[key] = value
    # The saved param groups may split the parameters differently (expert parallelism on or off): keep this
    # optimizer's groups and take each one's hyperparameters from the saved group that holds its first parameter.
    current = get_optimizer_state_dict(model, optimizer, options=_SHARDED)["param_groups"]
    by_param = {name: group for group in meta["param_groups"] for name in group["params"]}
    groups = [{**by_param[group["params"][0]], "params": group["params"]} for group in current if group["params"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=_SHARDED)


def _fit_scheduler(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A scheduler state for `groups` param groups (all groups share one schedule)."""
    state = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = state.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            state[key] = values[:1] * groups
    return state


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore everything save_checkpoint wrote, on this run's world size; returns the state (step, ...).

    Parses what it reads with errors naming the file, but checks no checksum: `resolve_resume` verifies first."""
    state = _read_state(path / "state.json")
    world = state["world_size"]
    model_files, optimizer_files = _files(path, "model", world), _files(path, "optimizer", world)
    layout = _Layout(model)
    _load_model(path, layout, _SavedPieces(model_files))
    _load_optimizer(path, model, optimizer, layout, _SavedPieces(optimizer_files), state["optimizer"])
    scheduler.load_state_dict(_fit_scheduler(state["scheduler"], len(optimizer.param_groups)))
    _set_rng_state(state["rng"])
    logger.info("resumed from %s (step %d, saved by %d ranks)", path, state["step"], world)
    return state


def _read_state(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file.parent} is incomplete: state.json is missing")
    try:
        state = json.loads(file.read_bytes())
    except ValueError as error:  # bad JSON or bad UTF-8
        raise CheckpointError(f"checkpoint state {file} is not valid JSON: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state {file} holds a JSON {type(state).__name__}, not an object")
    return state


def resolve_resume(root: Path, step: int | None, *, interval: tuple[str, int]) -> tuple[int, Path]:
    """(step, directory) of the checkpoint to resume from, verified: the given step's, or the newest intact one.

    Collective when distributed (see `verify_checkpoint`). A damaged newest checkpoint is logged, naming the
    file, and the one before it tried; a damaged checkpoint asked for by step is an error. `interval` is the
    setting that spaces the checkpoints and its value, which the error for a run with none names.
    """
    found = list_checkpoints(root)
    if not found:
        setting, every = interval
        written = f"every {every} steps" if every else "only at the end (0)"
        raise CheckpointError(
            f"nothing to resume: no complete checkpoint under {root}; with `{setting}` = {every} one is written "
            f"{written}, and the run stopped before its first: start it over (--overwrite), with a lower "
            f"`{setting}` to resume sooner"
        )
    if step is not None:
        if step not in found:
            raise CheckpointError(f"no checkpoint for step {step} under {root}; found steps {sorted(found)}")
        verify_checkpoint(found[step])
        return step, found[step]
    damaged = []
    for candidate in sorted(found, reverse=True):
        try:
            verify_checkpoint(found[candidate])
        except CheckpointError as error:
            logger.warning("%s; trying the checkpoint before it", error)
            damaged.append(str(error))
            continue
        if damaged:
            logger.warning("resuming from step %d, the newest intact checkpoint", candidate)
        return candidate, found[candidate]
    raise CheckpointError(f"nothing to resume: every checkpoint under {root} is damaged: {'; '.join(damaged)}")


def resume_step(config, model: torch.nn.Module, optimizer, scheduler) -> int:
    """Clear what an interrupted save or clean-up left, then restore the checkpoint `config.resume` asks for (if
    any), removing the ones past it; the step training continues after."""
    root = checkpoints_root(config.run_dir)
    if _rank() == 0:
        remove_leftovers(root)
    _barrier()
    if not config.resume.enabled:
        return 0
    step, path = resolve_resume(root, config.resume.step, interval=("ckpt.interval", config.ckpt.interval))
    if _rank() == 0:
        _discard_after(root, step)
    _barrier()
    return load_checkpoint(path, model, optimizer, scheduler)["step"]


def _discard_after(root: Path, step: int) -> None:
    """Remove the checkpoints past the one a run resumes from (damaged ones passed over, or later ones when an
    earlier step was asked for): they hold a history the resumed run replaces, and left in place they would
    count as the newest for `keep` (deleting the resumed run's own checkpoints) and for the next `--resume`."""
    for later, path in list_checkpoints(root).items():
        if later > step:
            logger.warning("removing checkpoint %s: the run continues from step %d instead", path, step)
            _discard(path)
