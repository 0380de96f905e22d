"""ModelArgs: the architecture-independent description of a decoder, parsed from a HF `config.json`.

Family files (`qwen3.py`, `llama.py`, ...) call `parse_decoder_args` with what is specific to them; everything
else reads the same keys for every Llama-style model. ModelArgs holds only what the checkpoint's config says; how a
run computes (kernels, router freezing) is `runtime.ModelRuntime`, given to `build_model` beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    partial_rotary_factor: float = 1.0  # the leading fraction of each head's dims that is rotated (GLM: 0.5)
    mrope_section: tuple[int, ...] = ()  # M-RoPE: frequencies per (time, height, width) axis; empty: plain RoPE
    mrope_interleaved: bool = False  # M-RoPE axes take frequencies in turn (Qwen3-VL), not in blocks (Qwen2.5-VL)


SCORING_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """Sparse MLP parameters; `layers` lists the decoder layers that are MoE (the rest are dense).

    Qwen3-MoE routes by softmax over all experts. DeepSeek-V3 / GLM-4.5 score each expert by a sigmoid, choose
    with a learned-offline `e_score_correction_bias` added (the weights themselves stay unbiased), first among
    the `topk_group` best of `n_group` expert groups, scale the weights by `routed_scaling_factor`, and add
    always-on shared experts (one dense SwiGLU of `shared_intermediate_size`; 0 = none).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    scoring: str = "softmax"
    score_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen3-Next: shared output times sigmoid(shared_expert_gate(x)), a [1, H] weight
    expert_activation: str = "swiglu"  # "relu2": ungated experts and shared expert, relu(up(x))^2 (Nemotron-H)

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCTIONS:
            raise ModelConfigError(f"MoE scoring {self.scoring!r} is not one of {SCORING_FUNCTIONS}")
        if self.num_experts % self.n_group:
            raise ModelConfigError(f"n_group={self.n_group} does not divide the {self.num_experts} experts")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ModelConfigError("group-limited routing scores a group by its top-2 experts: need >= 2 per group")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if self.top_k > self.topk_group * per_group:
            raise ModelConfigError(f"top_k={self.top_k} exceeds the {self.topk_group * per_group} selectable experts")


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from one shared low-rank latent per token.

    Queries: `q_lora_rank` None projects directly, else through a normed rank-`q_lora_rank` bottleneck. Each
    head's q/k is a `qk_nope_head_dim` part from the latent and a `qk_rope_head_dim` part carrying RoPE (the
    key's RoPE part is shared by all heads); values have `v_head_dim`. `rope_interleave`: checkpoints store the
    RoPE dims as interleaved pairs (DeepSeek's layout) rather than as two halves.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class IndexerArgs:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention, `layers.indexer`): per query, `num_heads`
    ReLU-scored heads of `head_dim` (the leading `qk_rope_head_dim` carrying RoPE) against one shared key per
    token choose the `topk` keys MLA attends to."""

    num_heads: int
    head_dim: int
    topk: int


LAYER_CACHES: dict[str, str | None] = {
    "full_attention": "kv",
    "linear_attention": "state",
    "mamba": "state",
    "mlp": None,
    "moe": None,
}
"""The layer kinds a config may name (`ModelArgs.layer_types`; each is a row of `decoder.LAYER_KINDS`) and what each
keeps between cached steps: K/V in the paged `KVCache`, a recurrent `StateCache` entry, or nothing."""
BLOCK_STYLES = ("decoder", "mixer")


@dataclass(frozen=True)
class MambaArgs:
    """Mamba-2 token mixers (Nemotron-H's `M` layers, `layers.mamba2`): `num_heads` heads of `head_dim`, B and C in
    `n_groups` groups of `state_size`, a causal depthwise conv of `conv_kernel` taps (with a bias if `conv_bias`)
    over x, B and C, `dt` clamped to `dt_limit` after softplus."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    time_step_min: float = 0.001  # dt_bias init (HF's scheme)
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ModelConfigError(f"mamba_num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and its cached state): x, B and C concatenated."""
        return self.inner_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class LinearAttnArgs:
    """Gated DeltaNet token mixers (Qwen3-Next's `linear_attention` layers, `layers.gated_deltanet`): `num_k_heads`
    query/key heads of `k_head_dim`, `num_v_heads` value heads of `v_head_dim` (a multiple of the key heads, each
    key head serving consecutive value heads), a causal depthwise conv of `conv_kernel` taps before them."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    chunk_size: int = 64
    flat_projections: bool = False
    """Qwen3.5: checkpoints hold `in_proj_qkv` (q, k, v of all heads in turn), `in_proj_z`, `in_proj_b` and
    `in_proj_a`, which the runtime's `in_proj_qkvz` / `in_proj_ba` concatenate in that order; Qwen3-Next's fused
    `in_proj_qkvz` / `in_proj_ba` group them per key head instead."""

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ModelConfigError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of {self.num_k_heads}")

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and its cached state): q, k and v concatenated."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


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
    attention_out_bias: bool = False  # o_proj's bias: attention_bias for Llama, never for GLM-4.5
    mlp_bias: bool = False
    moe: MoEArgs | None = None
    mla: MLAArgs | None = None  # multi-head latent attention instead of GQA (then num_kv_heads == num_heads)
    indexer: IndexerArgs | None = None  # DeepSeek-V3.2: MLA restricted to the indexer's top-k keys per query
    mtp_layers: int = 0  # multi-token-prediction layers checkpoints store after the decoder; never run or loaded
    layer_types: tuple[str, ...] = ()  # token mixer per layer (LAYER_CACHES); empty: all full_attention
    linear: LinearAttnArgs | None = None  # the linear_attention layers' shape (Gated DeltaNet)
    mamba: MambaArgs | None = None  # the mamba layers' shape (Mamba-2, Nemotron-H)
    block: str = "decoder"  # BLOCK_STYLES: norm + mixer + norm + MLP, or norm + one mixer (Nemotron-H)
    rope_free: bool = False  # attention without position embedding (Nemotron-H)
    mlp_activation: str = "swiglu"  # "swiglu" (gate_up_proj) or "relu2" (up_proj, relu(x)^2; Nemotron-H's mlp layers)
    norm_fp32_scale: bool = False  # RMSNorm weight applied in fp32 before the cast back (Nemotron-H)
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also yields a per-head gate; out * sigmoid(gate) -> o_proj
    zero_centered_norm: bool = False  # Qwen3-Next: RMSNorms scale by (1 + weight), weights initialised to 0
    vision_config: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    """A vision-language checkpoint's HF `vision_config` (Qwen3-VL): the model builds its vision tower from it."""
    vision_tower: str | None = None  # which tower reads `vision_config` (`decoder.VISION_TOWERS`), set by the family
    image_token_id: int | None = None  # the placeholder token an image's embeddings replace (vision-language)
    initializer_range: float = 0.02
    dtype: torch.dtype = torch.float32  # the checkpoint's (`dtype` / `torch_dtype`): what a load defaults to
    hf_config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_heads} is not a multiple of {self.num_kv_heads=}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelConfigError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_layers}")
        unknown = set(self.layer_types) - set(LAYER_CACHES)
        if unknown:
            raise ModelConfigError(
                f"layer types {sorted(unknown)} are not supported (supported: {tuple(LAYER_CACHES)})"
            )
        if "linear_attention" in self.layer_types and self.linear is None:
            raise ModelConfigError("linear_attention layers need LinearAttnArgs")
        if "mamba" in self.layer_types and self.mamba is None:
            raise ModelConfigError("mamba layers need MambaArgs")
        if self.block not in BLOCK_STYLES:
            raise ModelConfigError(f"block {self.block!r} is not one of {BLOCK_STYLES}")
        if self.block == "decoder" and {"mamba", "mlp", "moe"} & set(self.layer_types):
            raise ModelConfigError("mamba, mlp and moe layers are one-mixer blocks (block='mixer')")
        if (self.vision_config is None) != (self.vision_tower is None):
            raise ModelConfigError("a vision tower needs both vision_config and vision_tower")
        if "moe" in self.layer_types and self.moe is None:
            raise ModelConfigError("moe layers need MoEArgs")

    @property
    def rotary_dim(self) -> int:
        """How many dims of each q/k head RoPE rotates (the leading ones; MLA: the separate RoPE part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """The (query/key, value) head dims the attention layers attend with."""
        if self.mla is not None:
            return self.mla.qk_head_dim, self.mla.v_head_dim
        return self.head_dim, self.head_dim

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """Per layer and token, what the KV cache stores: (heads, key dim, value dim).

        MLA caches the normed latent and the rotated shared RoPE key as one key-only head (value dim 0): the
        values are the latent's leading `kv_lora_rank` dims (see `layers.mla`). With an indexer (V3.2) the row
        also holds the token's indexer key, `head_dim` more values (see `layers.indexer`).
        """
        if self.mla is not None:
            index_dim = self.indexer.head_dim if self.indexer is not None else 0
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim + index_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    def layer_type(self, layer: int) -> str:
        """The token mixer of decoder layer `layer`: `full_attention` (softmax attention, KV cache),
        `linear_attention` (Gated DeltaNet) or `mamba` (Mamba-2), both with a recurrent state cache, or `mlp` or
        `moe` (one-mixer blocks of a dense or sparse MLP)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged cache (`LAYER_CACHES`: the `full_attention` ones)."""
        return tuple(i for i in range(self.num_layers) if LAYER_CACHES[self.layer_type(i)] == "kv")

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (`layers.state_cache.StateCache`) instead of K/V."""
        return any(LAYER_CACHES[t] == "state" for t in self.layer_types)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def replace(self, **changes: Any) -> ModelArgs:
        """A copy with `changes` (what a family's parser sets after `parse_decoder_args`)."""
        return dataclasses.replace(self, **changes)


FLOAT_TAG = "__float__"
"""transformers' spelling of a non-finite float in `config.json` (`{"__float__": "Infinity"}`; strict JSON has no
Infinity or NaN), as `PreTrainedConfig._encode_special_floats` writes it (e.g. Nemotron-H's `time_step_limit`)."""
TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_floats(value: Any) -> Any:
    """`value` with every `{"__float__": "Infinity" | "-Infinity" | "NaN"}` object, at any depth, replaced by the
    float, as transformers' `_decode_special_floats` reads a config; any other object or list is kept as it is."""
    if isinstance(value, dict):
        if set(value) == {FLOAT_TAG} and isinstance(value[FLOAT_TAG], str):
            return TAGGED_FLOATS.get(value[FLOAT_TAG], value)
        return {k: decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_floats(v) for v in value]
    return value


def encode_floats(value: Any) -> Any:
    """`decode_floats` inverted, as transformers' `_encode_special_floats` writes a config: non-finite floats as
    `{"__float__": ...}` objects (tuples become lists, as JSON writes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_TAG: "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, Mapping):
        return {k: encode_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_floats(v) for v in value]
    return value


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The `config.json` of a HF directory (or the file itself) as a dict, read as transformers reads it: tagged
    non-finite floats (`decode_floats`) and the bare `Infinity` / `NaN` of older writers become floats. Every
    reader of a model's config.json goes through here."""
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
    return decode_floats(config)


def hf_config_json(config: Mapping[str, Any]) -> str:
    """`config` as the text of a `config.json`, in transformers' spelling: strict JSON, with non-finite floats
    tagged (`encode_floats`) as transformers 5.17-5.25 write and read them (`read_hf_config` too)."""
    return json.dumps(encode_floats(config), indent=2, allow_nan=False) + "\n"


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


def parse_rope(hf: Mapping[str, Any], partial_rotary_factor: float | None = None) -> RopeArgs:
    """Read RoPE from either config format; reject scaling types whose frequencies depend on the input length.

    `partial_rotary_factor`: the family's default for a config that does not set it (GLM-4.5: 0.5); None for
    families whose attention rotates whole heads, which then reject any other value.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    default_partial = 1.0 if partial_rotary_factor is None else partial_rotary_factor
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial)))
    if partial_rotary_factor is None and partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor != 1 is not supported for {hf.get('architectures')}")
    if not 0 < partial <= 1:
        raise ModelConfigError(f"partial_rotary_factor {partial} is not in (0, 1]")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        mrope = tuple(int(n) for n in params.get("mrope_section") or ())
        interleaved = bool(params.get("mrope_interleaved", False))
        return RopeArgs(theta=theta, partial_rotary_factor=partial, mrope_section=mrope, mrope_interleaved=interleaved)
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original:
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise ModelConfigError(f"rope_type {rope_type!r} needs a 'factor'")
    known = {f.name for f in dataclasses.fields(RopeArgs)}
    extra = {k: v for k, v in params.items() if k in known and k not in ("factor", "type") and v is not None}
    extra["original_max_position_embeddings"] = original
    fixed = {"theta": theta, "type": rope_type, "factor": float(factor), "partial_rotary_factor": partial}
    return RopeArgs(**{**extra, **fixed})


def parse_decoder_args(
    hf: Mapping[str, Any],
    *,
    qk_norm: bool,
    moe: MoEArgs | None = None,
    mlp_bias: bool = False,
    rope: RopeArgs | None = None,
    **family: Any,
) -> ModelArgs:
    """The fields every Llama-style decoder shares; the family passes what differs (`rope` when it reads RoPE
    its own way, any other ModelArgs field in `family`)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ModelConfigError("sliding-window attention is not supported")
    hidden, heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    fields: dict[str, Any] = dict(
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
        rope=rope or parse_rope(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=mlp_bias,
        moe=moe,
        initializer_range=hf.get("initializer_range", 0.02),
        dtype=parse_dtype(hf),
        hf_config=dict(hf),
    )
    return ModelArgs(**{**fields, **family})
