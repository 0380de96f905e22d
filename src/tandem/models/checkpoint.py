"""Hugging Face checkpoints in and out: the runtime <-> HF weight layout, safetensors reading, atomic sharded saving.

`weight_map` is the single description of the layout conversion: for every runtime tensor, the HF tensors it is
made of (concatenated along dim 0 for fused QKV and gate/up; additionally stacked over experts for MoE). Loading
builds runtime tensors from it; saving splits them back, so a saved directory has exactly the HF keys, shapes
and values that `transformers` expects.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .architecture import HFLayout
from .config import ModelArgs, MoEArgs, hf_config_json
from .decoder import vision_tower
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


@dataclass(frozen=True)
class Fused:
    """One runtime tensor from HF tensors: each group in `parts` is concatenated on dim 0 (`sizes` rows each,
    when there are several); the groups are stacked on a new dim 0 when `stacked` (experts)."""

    parts: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...] | None = None
    stacked: bool = False

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return tuple(k for group in self.parts for k in group)


def _plain(key: str) -> Fused:
    return Fused(((key,),))


def weight_map(args: ModelArgs, layout: HFLayout, stacked_experts: bool = False) -> dict[str, Fused]:
    """Runtime parameter name -> the HF tensors it is built from (see module docstring)."""
    top = layout.prefix
    out = {
        "embed_tokens.weight": _plain(f"{top}{layout.embed_tokens}.weight"),
        "norm.weight": _plain(f"{top}{layout.final_norm}.weight"),
    }
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = _plain("lm_head.weight")
    for i in range(args.num_layers):
        hf, rt = f"{top}layers.{i}.", f"layers.{i}."
        if args.block == "mixer":  # Nemotron-H: norm + one mixer, HF's names unchanged
            block = _mixer_block_weights(args, i, layout, stacked_experts)
            out |= {rt + name: _under(hf, fused) for name, fused in block.items()}
            continue
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{rt}{norm}.weight"] = _plain(f"{hf}{norm}.weight")
        if args.layer_type(i) == "linear_attention":
            attention = _linear_attention_weights(args)
        else:
            attention = _mla_weights(args) if args.mla is not None else _gqa_weights(args)
        if args.moe is not None and args.is_moe_layer(i):
            mlp = _moe_weights(args.moe, layout, stacked_experts)
        else:
            mlp = _mlp_weights("mlp.", args.intermediate_size, args.mlp_bias)
        out |= {rt + name: _under(hf, fused) for name, fused in (attention | mlp).items()}
    if args.vision_config is not None:  # the vision tower: HF's names under `model.visual.`
        out |= {f"visual.{name}": _plain(f"model.visual.{name}") for name in vision_parameters(args)}
    return out


def vision_parameters(args: ModelArgs) -> list[str]:
    """A vision tower's parameter names (HF's, under `model.visual.`), from one built on the meta device."""
    with torch.device("meta"):
        tower = vision_tower(args)
    return [] if tower is None else [name for name, _ in tower.named_parameters()]


def _under(prefix: str, fused: Fused) -> Fused:
    """`fused` with `prefix` before every HF key (a layer's `model.layers.{i}.`)."""
    return dataclasses.replace(fused, parts=tuple(tuple(prefix + k for k in group) for group in fused.parts))


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _gqa_weights(args: ModelArgs) -> dict[str, Fused]:
    """Within a layer: fused QKV (+ bias), o_proj (+ bias), qk-norm."""
    kv_size = args.num_kv_heads * args.head_dim
    q_size = args.num_heads * args.head_dim * (2 if args.attn_output_gate else 1)  # gated: q_proj holds the gate too
    out = {}
    for kind in _kinds(args.attention_bias):
        qkv = tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv")
        out[f"self_attn.qkv_proj.{kind}"] = Fused((qkv,), (q_size, kv_size, kv_size))
    out |= {f"self_attn.o_proj.{kind}": _plain(f"self_attn.o_proj.{kind}") for kind in _kinds(args.attention_out_bias)}
    norms = ("q_norm", "k_norm") if args.qk_norm else ()
    return out | {f"self_attn.{n}.weight": _plain(f"self_attn.{n}.weight") for n in norms}


def _mixer_block_weights(args: ModelArgs, layer: int, layout: HFLayout, stacked_experts: bool) -> dict[str, Fused]:
    """Within a one-mixer block (Nemotron-H): `norm` and the mixer's tensors, all under HF's names (`mixer.*`)."""
    kind = args.layer_type(layer)
    names = ["norm.weight"]
    if kind == "moe":
        assert args.moe is not None
        moe = _moe_weights(args.moe, layout, stacked_experts)
        return {"norm.weight": _plain("norm.weight")} | {"mixer." + k.removeprefix("mlp."): f for k, f in moe.items()}
    if kind == "mamba":
        m = args.mamba
        assert m is not None
        names += ["mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.dt_bias", "mixer.A_log", "mixer.D"]
        names += ["mixer.norm.weight", "mixer.out_proj.weight"]
        names += ["mixer.conv1d.bias"] if m.conv_bias else []
        names += ["mixer.in_proj.bias", "mixer.out_proj.bias"] if m.proj_bias else []
    elif kind == "mlp":
        names += [f"mixer.{p}_proj.{k}" for p in ("up", "down") for k in _kinds(args.mlp_bias)]
    else:
        gqa = _gqa_weights(args)
        return {"norm.weight": _plain("norm.weight")} | {
            "mixer." + name.removeprefix("self_attn."): _under("mixer.", _strip(fused, "self_attn."))
            for name, fused in gqa.items()
        }
    return {n: _plain(n) for n in names}


def _strip(fused: Fused, prefix: str) -> Fused:
    return dataclasses.replace(fused, parts=tuple(tuple(k.removeprefix(prefix) for k in g) for g in fused.parts))


def _linear_attention_weights(args: ModelArgs) -> dict[str, Fused]:
    """Within a layer: the Gated DeltaNet's tensors under HF's names; Qwen3.5's separate input projections are
    concatenated into the runtime's `in_proj_qkvz` and `in_proj_ba` (`LinearAttnArgs.flat_projections`)."""
    la = args.linear
    assert la is not None
    names = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
    out = {f"linear_attn.{n}": _plain(f"linear_attn.{n}") for n in names}
    if not la.flat_projections:
        return out | {
            f"linear_attn.{n}": _plain(f"linear_attn.{n}") for n in ("in_proj_qkvz.weight", "in_proj_ba.weight")
        }
    value_dim = la.num_v_heads * la.v_head_dim
    qkvz = tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z"))
    ba = tuple(f"linear_attn.in_proj_{p}.weight" for p in "ba")
    out["linear_attn.in_proj_qkvz.weight"] = Fused((qkvz,), (la.conv_dim, value_dim))
    out["linear_attn.in_proj_ba.weight"] = Fused((ba,), (la.num_v_heads, la.num_v_heads))
    return out


def _mla_weights(args: ModelArgs) -> dict[str, Fused]:
    """Within a layer: MLA's projections and latent norms, unfused, under HF's names."""
    assert args.mla is not None
    low_rank_q = args.mla.q_lora_rank is not None
    names = [
        *(("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") if low_rank_q else ("q_proj.weight",)),
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    ]
    if args.attention_bias:
        names += [*(("q_a_proj.bias",) if low_rank_q else ()), "kv_a_proj_with_mqa.bias"]
    if args.attention_out_bias:
        names.append("o_proj.bias")
    if args.indexer is not None:  # DeepSeek-V3.2's lightning indexer (`layers.indexer`)
        names += [f"indexer.{n}" for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias")]
        names.append("indexer.weights_proj.weight")
    return {f"self_attn.{n}": _plain(f"self_attn.{n}") for n in names}


def _mlp_weights(prefix: str, size: int, bias: bool, hf_prefix: str | None = None) -> dict[str, Fused]:
    """Within a layer: a dense SwiGLU at `prefix` (the MLP, or a MoE's shared experts; `hf_prefix` on disk when it
    differs), gate and up fused."""
    hf = prefix if hf_prefix is None else hf_prefix
    out = {}
    for kind in _kinds(bias):
        gate_up = (f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}")
        out[f"{prefix}gate_up_proj.{kind}"] = Fused((gate_up,), (size, size))
        out[f"{prefix}down_proj.{kind}"] = _plain(f"{hf}down_proj.{kind}")
    return out


UNGATED = ("up_proj", "down_proj")
"""An ungated MLP's projections (Nemotron-H's shared expert)."""


def _moe_weights(moe: MoEArgs, layout: HFLayout, stacked_experts: bool) -> dict[str, Fused]:
    """Within a layer: router (+ correction bias), experts stacked from per-expert tensors, shared experts."""
    out = {"mlp.router.weight": _plain(layout.router)}
    if moe.score_correction_bias:
        out["mlp.router.e_score_correction_bias"] = _plain(layout.router_bias)
    if moe.shared_intermediate_size and moe.expert_activation == "swiglu":
        out |= _mlp_weights("mlp.shared_experts.", moe.shared_intermediate_size, False, layout.shared_experts)
    elif moe.shared_intermediate_size:  # ungated, as its experts
        out |= {f"mlp.shared_experts.{p}.weight": _plain(f"{layout.shared_experts}{p}.weight") for p in UNGATED}
    if moe.shared_intermediate_size and moe.shared_expert_gate:
        out["mlp.shared_expert_gate.weight"] = _plain(layout.shared_expert_gate)
    gate, up, down = (layout.expert.replace("{proj}", proj) for proj in layout.expert_projs)
    experts = range(moe.num_experts)
    if moe.expert_activation != "swiglu":  # ungated experts (Nemotron-H), stored one by one
        out["mlp.experts.up_proj"] = Fused(tuple((up.format(expert=e),) for e in experts), stacked=True)
        out["mlp.experts.down_proj"] = Fused(tuple((down.format(expert=e),) for e in experts), stacked=True)
        return out
    if stacked_experts:
        out["mlp.experts.gate_up_proj"] = _plain(layout.stacked_gate_up)
        out["mlp.experts.down_proj"] = _plain(layout.stacked_down)
        return out
    size = moe.intermediate_size
    out["mlp.experts.gate_up_proj"] = Fused(
        tuple((gate.format(expert=e), up.format(expert=e)) for e in experts), (size, size), stacked=True
    )
    out["mlp.experts.down_proj"] = Fused(tuple((down.format(expert=e),) for e in experts), stacked=True)
    return out


def _layout(args: ModelArgs) -> HFLayout:
    return ARCHITECTURES[args.architecture].layout


def hf_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their HF names and shapes (views of the runtime tensors, no copies)."""
    state = model.state_dict()
    layout = _layout(model.args)
    for name, fused in weight_map(model.args, layout, stacked_experts=layout.save_stacked_experts).items():
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
    wanted = weight_map(args, layout, stacked_experts=stacked)
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
