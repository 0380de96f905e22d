"""Hugging Face checkpoints in and out: safetensors reading (confined or not), key checks, atomic sharded saving.

What each runtime tensor is made of on disk is `decoder.weight_map` (the modules' own `hf_weights`, put together
under their blocks): loading concatenates (fused QKV and gate/up) and stacks (experts) the HF tensors it names;
saving splits them back, so a saved directory has exactly the HF keys, shapes and values `transformers` expects.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import ModelArgs, hf_config_json
from .decoder import weight_map
from .hf_layout import Fused, HFLayout
from .registry import ARCHITECTURES

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",  # a vision-language model's image processor
)
_IGNORED_HF_KEYS = re.compile(r".*rotary_emb\.inv_freq$|mtp\.")  # RoPE tables; Qwen3-Next's MTP weights
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class ModelWeightsError(ValueError):
    """A checkpoint that cannot be loaded: names the file that is unreadable, truncated or not valid safetensors
    or JSON, or the missing, unexpected or mis-shaped tensors."""


class OutsideDirectoryError(ModelWeightsError):
    """A file a load would open lies outside the directory it is confined to (through `..`, an absolute path in
    the index, or a symlink)."""


def resolve_inside(path: str | Path, root: str | Path) -> Path:
    """`path` with every symlink resolved, or OutsideDirectoryError unless it lies inside `root` (resolved too).

    The one path check for weight loading: the server's weights directory for the checkpoint a request names,
    and the checkpoint directory for every file a confined load opens (the index may name `../x` or `/x`, and
    any file may be a symlink).
    """
    root = Path(root).resolve()
    real = Path(path).resolve()
    if not real.is_relative_to(root):
        shown = f"{path} (resolving to {real})" if real != Path(path) else str(path)
        raise OutsideDirectoryError(f"{shown} is outside {root}")
    return real


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds no NaN and no infinity (a non-float tensor always does): the one finiteness check of
    every weight tandem reads or writes (a served checkpoint, an adapter, a merged model), since one NaN poisons
    every activation computed from it.

    One min/max reduction reads the tensor once and allocates nothing (NaN propagates into both, an infinity
    shows as an infinite extreme), where `isfinite(t).all()` writes a whole boolean copy first.
    """
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _layout(args: ModelArgs) -> HFLayout:
    return ARCHITECTURES[args.architecture].layout


def hf_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their HF names and shapes (views of the runtime tensors, no copies)."""
    state = model.state_dict()
    layout = _layout(model.args)
    for name, fused in weight_map(model.args, layout).items():
        groups = state[name].unbind(0) if fused.stacked else (state[name],)
        for group, keys in zip(groups, fused.parts, strict=True):
            yield from zip(keys, group.split(fused.sizes) if fused.sizes else (group,), strict=True)


def _read_index(index: Path) -> dict[str, str]:
    """The index's tensor name -> file name map, or ModelWeightsError naming the index."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:  # ValueError covers bad JSON and bad UTF-8
        raise ModelWeightsError(f"{index} is not a valid safetensors index ({type(error).__name__}: {error})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelWeightsError(f"{index}: weight_map is not a mapping of tensor names to file names")
    return weight_map


def open_safetensors(file: Path) -> Any:
    """`safe_open(file)`, or ModelWeightsError naming the file (missing, truncated, empty or a corrupt header)."""
    try:
        return safe_open(file, "pt")
    except Exception as error:  # SafetensorError has no importable base besides Exception
        raise ModelWeightsError(f"{file} is not a readable safetensors file: {error}") from None


class _Reader:
    """Lazy, per-tensor access to the safetensors of a HF directory (one file, or shards with an index).

    With `confined`, every file (the index, each shard) must lie inside `path` once symlinks are resolved; a
    directory the user named is trusted (it may be a hub-cache snapshot whose files link to `../../blobs`).
    """

    def __init__(self, path: Path, confined: bool = False) -> None:
        def checked(file: Path) -> Path:
            return resolve_inside(file, path) if confined else file

        index = path / INDEX_FILE
        if index.is_file():
            names = _read_index(checked(index))
            self.files = {key: checked(path / name) for key, name in names.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelWeightsError(f"missing weights: no *.safetensors files (or {INDEX_FILE}) in {path}")
            self.files = {}
            for file in map(checked, files):
                with open_safetensors(file) as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        self._open: dict[Path, Any] = {}

    def get(self, key: str) -> torch.Tensor:
        file = self.files[key]
        if file not in self._open:
            self._open[file] = open_safetensors(file)
        try:
            return self._open[file].get_tensor(key)
        except Exception as error:  # a shard without the key its index names, or unreadable data
            raise ModelWeightsError(f"{file}: cannot read tensor {key}: {error}") from None


def _ignored(key: str, args: ModelArgs) -> bool:
    """RoPE tables, Qwen3-Next's `mtp.*` weights, and the multi-token-prediction layers stored after the decoder (`model.layers.{num_layers}...`),
    which transformers skips too: tandem does not run them, and saves without them."""
    if _IGNORED_HF_KEYS.match(key):
        return True
    layer = _LAYER_INDEX.match(key)
    return layer is not None and args.num_layers <= int(layer[1]) < args.num_layers + args.mtp_layers


def _check_keys(available: set[str], wanted: Mapping[str, Fused], args: ModelArgs, path: Path) -> None:
    needed = {k for fused in wanted.values() for k in fused.hf_keys}
    missing = sorted(needed - available)
    ignorable = {"lm_head.weight"} if args.tie_word_embeddings else set()
    unexpected = sorted(k for k in available - needed - ignorable if not _ignored(k, args))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
    if problems:
        raise ModelWeightsError(f"{path} does not match {args.architecture}: " + "; ".join(problems))


def iter_runtime_tensors(
    path: str | Path, args: ModelArgs, *, confined: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(runtime name, tensor) one at a time from a HF directory, in checkpoint dtype, on CPU.

    Checks every key first, so a bad checkpoint fails before anything is loaded. Experts may be stored per
    expert (what transformers writes) or already stacked (`mlp.experts.gate_up_proj` `[E, 2I, H]`). With
    `confined`, every file opened must lie inside `path` (symlinks resolved): for directories a request names.
    """
    path = Path(path)
    reader = _Reader(path, confined)
    layout = _layout(args)
    stored = _stored_keys(reader.files, layout)
    stacked = any(k.endswith(layout.stacked_gate_up) for k in stored)
    wanted = weight_map(args, dataclasses.replace(layout, stacked_experts=stacked))
    _check_keys(set(stored), wanted, args, path)
    for name, fused in wanted.items():
        groups = [
            reader.get(stored[keys[0]]) if len(keys) == 1 else torch.cat([reader.get(stored[k]) for k in keys])
            for keys in fused.parts
        ]
        yield name, torch.stack(groups) if fused.stacked else groups[0]


def _stored_keys(keys: Iterable[str], layout: HFLayout) -> dict[str, str]:
    """HF key as `weight_map` names it -> the key on disk: `layout.load_renames` applied, `load_skips` left out."""
    out = {}
    for key in keys:
        if layout.load_skips and key.startswith(layout.load_skips):
            continue
        name = next((new + key[len(old) :] for old, new in layout.load_renames if key.startswith(old)), key)
        out[name] = key
    return out


def load_weights(
    model: nn.Module, path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> nn.Module:
    """Fill `model` (possibly on `meta`) from a HF directory, tensor by tensor; meta parameters are materialised
    on `device` (default CPU), others are copied in place."""
    params = dict(model.named_parameters())
    for name, tensor in iter_runtime_tensors(path, model.args):
        param = params[name]
        if tensor.shape != param.shape:
            raise ModelWeightsError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
            )
        if param.is_meta:
            module_name, _, attr = name.rpartition(".")
            value = tensor.to(device=device or "cpu", dtype=dtype or param.dtype)
            setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=param.requires_grad))
        else:
            with torch.no_grad():
                param.copy_(tensor)
    model.rotary.init_buffers(model.embed_tokens.weight.device)
    return model


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot parse size {size!r}; use bytes or e.g. '5GB', '500MB'")
    unit = (match.group(2) or "B").upper().replace("I", "")
    return int(float(match.group(1)) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[unit])


def _plan_shards(tensors: list[tuple[str, torch.Tensor]], max_bytes: int, dtype: torch.dtype | None) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, t) in enumerate(tensors):
        nbytes = t.numel() * (t.element_size() if dtype is None else dtype.itemsize)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def save_model(
    model: nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a HF directory (`config.json`, safetensors, tokenizer and generation config) that transformers loads.

    Shards above `max_shard_size` and writes `model.safetensors.index.json`. Everything is written to a
    temporary sibling directory first and renamed into place, so `path` is never half-written; what an earlier,
    killed save of `path` left beside it is removed first. Tokenizer files come from `tokenizer_dir`, else from
    the directory the model was loaded from (`model.source_dir`).
    """
    path = Path(path)
    args: ModelArgs = model.args
    tensors = list(hf_tensors(model))
    shards = _plan_shards(tensors, _parse_size(max_shard_size), dtype)
    _remove_interrupted_saves(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        weight_files: dict[str, str] = {}
        for n, shard in enumerate(shards, start=1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            chunk = {tensors[i][0]: tensors[i][1].detach().to("cpu", dtype).clone() for i in shard}
            save_file(chunk, tmp / file, metadata={"format": "pt"})
            weight_files.update(dict.fromkeys(chunk, file))
        if len(shards) > 1:
            total = sum(t.numel() * (dtype.itemsize if dtype else t.element_size()) for _, t in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": weight_files}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(hf_config_json(_hf_config(args, dtype or tensors[0][1].dtype)))
        source = tokenizer_dir or getattr(model, "source_dir", None)
        for name in TOKENIZER_FILES if source else ():
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, tmp / name)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    if not args.hf_config:
        raise ValueError("ModelArgs has no hf_config to write; build models from a HF config dict or directory")
    config = dict(args.hf_config)
    config["architectures"] = [args.architecture]
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[key] = str(dtype).removeprefix("torch.")
    return config


def _remove_interrupted_saves(path: Path) -> None:
    """Delete the temporary and moved-aside siblings (`.<name>.tmp-*`, `.<name>.old-*`) a killed save left."""
    if path.parent.is_dir():
        for kind in ("tmp", "old"):
            for stale in path.parent.glob(f".{glob.escape(path.name)}.{kind}-*"):
                shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`; an existing `path` is moved aside first and removed after the swap."""
    if not path.exists():
        os.replace(tmp, path)
        return
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old)
