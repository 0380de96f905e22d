"""ModelArgs: the architecture-independent description of a decoder, parsed from a HF `config.json`.

Family files (`qwen3.py`, `llama.py`, ...) call `parse_decoder_args` with what is specific to them; everything
else reads the same keys for every Llama-style model. Runtime choices that HF configs do not have (attention and
MoE backends, router freezing) live here too, with defaults, so the trainer and inference configure one object.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A `config.json` that tandem cannot run: says which key is missing or unsupported."""


@dataclass(frozen=True)
class RopeArgs:
    """RoPE parameters, from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoEArgs:
    """Sparse MLP parameters; `layers` lists the decoder layers that are MoE (the rest are dense)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build a model; `hf_config` is the original dict, written back unchanged on save."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeArgs
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    moe: MoEArgs | None = None
    initializer_range: float = 0.02
    dtype: torch.dtype = torch.float32
    # Runtime choices (not part of the HF config).
    attn_backend: str = "auto"
    moe_backend: str | tuple[str, ...] = "grouped_mm"
    freeze_router: bool = False
    moe_balanced_routing: bool = False  # benchmarks: round-robin experts, every expert gets the same tokens
    rope_backend: str = "torch"  # a name in layers.rope.ROPE_BACKENDS
    swiglu_backend: str = "torch"  # a name in layers.mlp.SWIGLU_BACKENDS (dense MLPs)
    hf_config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ModelConfigError(f"attn_backend {self.attn_backend!r} is not one of {ATTENTION_BACKENDS}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_heads} is not a multiple of {self.num_kv_heads=}")
        if isinstance(self.moe_backend, tuple) and len(self.moe_backend) != self.num_layers:
            raise ModelConfigError(
                f"moe_backend has {len(self.moe_backend)} entries, expected one per layer ({self.num_layers})"
            )

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def moe_backend_for(self, layer: int) -> str:
        return self.moe_backend[layer] if isinstance(self.moe_backend, tuple) else self.moe_backend

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with runtime options (or anything else) changed; lists become tuples."""
        if isinstance(changes.get("moe_backend"), list):
            changes["moe_backend"] = tuple(changes["moe_backend"])
        return dataclasses.replace(self, **changes)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The `config.json` of a HF directory (or the file itself) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ModelConfigError(f"no config.json at {path}")
    try:
        config = json.loads(file.read_bytes())
    except ValueError as error:  # bad JSON or bad UTF-8
        raise ModelConfigError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def require(hf: Mapping[str, Any], key: str) -> Any:
    """`hf[key]`, or a ModelConfigError naming the key and the architecture."""
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json for {hf.get('architectures')} is missing required key {key!r}")
    return hf[key]


def parse_dtype(hf: Mapping[str, Any]) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ModelConfigError(f"config.json dtype {name!r} is not a torch dtype")
    return dtype


def parse_rope(hf: Mapping[str, Any]) -> RopeArgs:
    """Read RoPE from either config format; reject scaling types whose frequencies depend on the input length."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeArgs(theta=theta)
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise ModelConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    known = {f.name for f in dataclasses.fields(RopeArgs)}
    extra = {k: v for k, v in params.items() if k in known and k not in ("factor", "type") and v is not None}
    extra["original_max_position_embeddings"] = original
    return RopeArgs(**{**extra, "theta": theta, "type": rope_type, "factor": float(factor)})


def parse_decoder_args(
    hf: Mapping[str, Any], *, qk_norm: bool, moe: MoEArgs | None = None, mlp_bias: bool = False
) -> ModelArgs:
    """The fields every Llama-style decoder shares; the family passes what differs."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ModelConfigError("sliding-window attention is not supported")
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    return ModelArgs(
        architecture=require(hf, "architectures")[0],
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=require(hf, "intermediate_size"),
        num_layers=require(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope=parse_rope(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=mlp_bias,
        moe=moe,
        initializer_range=hf.get("initializer_range", 0.02),
        dtype=parse_dtype(hf),
        hf_config=dict(hf),
    )
