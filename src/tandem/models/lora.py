"""LoRA adapters on tandem's runtime layouts, saved and loaded in PEFT's format (docs/lora.md).

A targeted projection becomes a `LoraLinear`: still an `nn.Linear` with the same `weight` and `bias` (so every
runtime and HF name of the base model is unchanged), plus one low-rank pair per Hugging Face projection it holds.
A fused projection holds several: `qkv_proj` (rows q heads, k heads, v heads) holds `q_proj`, `k_proj` and
`v_proj`, `gate_up_proj` holds `gate_proj` and `up_proj`; a plain one (`o_proj`, `down_proj`, MLA's `q_proj`) holds
itself. Each pair maps 1:1 to PEFT's `<hf module>.lora_A/B.weight`, and only targeted segments get one:

    y = base(x) + concat over segments s of (scale * B_s(A_s(dropout(x))) if s is targeted else 0)

with `scale = alpha / rank`, A kaiming-uniform(a=sqrt(5)) and B zeros, as PEFT initialises them. Adapter
parameters are fp32 and named `<module>.lora_A.<hf projection>.weight` (`layers.0.self_attn.qkv_proj.lora_A.q_proj
.weight`); the base weights are frozen (`requires_grad=False`). Dense MLPs and shared experts are adapted by the
same names; routed MoE experts only with `LoraArgs.experts`: the stacked `Experts` become `LoraExperts`, one
low-rank pair per expert on each stacked projection, stored as PEFT's `target_parameters` stores them
(`experts.lora_A.gate_up_proj` `[E * r, H]`, PEFT's `mlp.experts.base_layer.lora_A.weight`).

Functions: `apply_lora`, `lora_args`, `lora_parameters`, `adapter_state_dict`, `is_adapter_name`, `peft_key`,
`to_peft_state_dict`, `from_peft_state_dict`, `peft_config`, `save_adapter`, `write_adapter`, `read_adapter` (the
one loader of adapter files: `read_adapter_config`, `check_adapter_tensors`), `load_peft_adapter`, `merge_lora`, `fold_adapters` (serving: adapters folded into the weights, a base copy kept),
`route_adapters` (serving base and adapter side by side: a per-row gate on the adapters' output).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoint import _remove_interrupted_saves, _replace_dir, all_finite
from .config import ModelArgs
from .layers.moe import Experts, LowRank
from .registry import ARCHITECTURES

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Hugging Face projection names adapters may target."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's own parameter names in a saved adapter."""
PEFT_VERSION = "0.21.2"
"""The PEFT version whose `adapter_config.json` keys `peft_config` writes."""
MAX_LORA_SCALE = 1000.0
"""The largest scale `alpha / rank` an adapter may have. Recipes use 0.5 to 64 (alpha = r or 2r; alpha 64 at rank
1); an output scaled by over a thousand is a mistyped `lora_alpha`, which folded into bf16 or fp16 weights
overflows them."""
ADAPTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes adapter tensors may have in a file (an integer adapter would be cast to a no-op)."""
ADAPTER_CONFIG_BYTES = 1 << 20
"""The largest `adapter_config.json` read (PEFT writes about 2 KB)."""

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")
_ADAPTER = re.compile(r"^(?P<module>.+)\.(?P<runtime>[^.]+)\.lora_(?P<ab>[AB])\.(?P<proj>[^.]+)\.weight$")
_EXPERT_ADAPTER = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<param>gate_up_proj|up_proj|down_proj)$")
EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")
"""The stacked expert parameters expert adapters go on (PEFT `target_parameters` `experts.<name>`): the first
projection (`gate_up_proj`, or `up_proj` for ungated experts) and `down_proj`, always both."""


class LoraError(ValueError):
    """An adapter that does not fit the model, or a PEFT adapter tandem cannot load; the message says which."""


@dataclass(frozen=True)
class LoraArgs:
    """What `apply_lora` adds: rank r, alpha (scale = alpha / r), input dropout, the HF projections targeted."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    experts: bool = False
    """Adapters on the routed experts' stacked projections too (`LoraExperts`)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise LoraError(f"LoRA rank must be positive (an integer), got {self.rank!r}")
        try:
            alpha = float(self.alpha)
        except (TypeError, ValueError, OverflowError):
            alpha = math.nan
        if isinstance(self.alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
            raise LoraError(f"LoRA alpha must be a positive, finite number, got {self.alpha!r}")
        if alpha / self.rank > MAX_LORA_SCALE:
            raise LoraError(
                f"LoRA scale alpha / rank = {alpha:g} / {self.rank} = {alpha / self.rank:g} is over {MAX_LORA_SCALE:g} "
                "(tandem's bound: recipes use 0.5 to 64); is alpha mistyped?"
            )
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not (self.target_modules or self.experts):
            raise LoraError(f"unknown LoRA targets {unknown}; valid: {', '.join(LORA_TARGETS)}")
        if not 0 <= self.dropout < 1:
            raise LoraError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.experts and self.dropout:
            raise LoraError("LoRA dropout does not run on routed experts' adapters (nor in PEFT): set it to 0")
        object.__setattr__(self, "target_modules", tuple(dict.fromkeys(self.target_modules)))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, section: Any, *, dropout: float | None = None) -> LoraArgs:
        """From a `[model.lora]` config section (anything with its fields); `dropout` overrides its own (a server
        runs adapters without dropout)."""
        return cls(
            rank=section.rank,
            alpha=section.alpha,
            dropout=section.dropout if dropout is None else dropout,
            target_modules=tuple(section.target_modules),
            experts=section.experts,
        )

    @property
    def layout(self) -> tuple[int, float, frozenset[str], bool]:
        """What two adapters must share to replace one another: rank, alpha, targets."""
        return self.rank, self.alpha, frozenset(self.target_modules), self.experts

    def __str__(self) -> str:
        experts = " and the routed experts" if self.experts else ""
        return f"rank {self.rank}, alpha {self.alpha:g} on {', '.join(self.target_modules)}{experts}"


class LoraLinear(nn.Linear):
    """An `nn.Linear` (the same `weight` and `bias` objects as the one it replaces) with adapters on some of its
    row segments; `segments` are (HF projection, rows) in row order."""

    def __init__(self, base: nn.Linear, segments: tuple[tuple[str, int], ...], args: LoraArgs) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.lora = args
        self.sizes = tuple(size for _, size in segments)
        self.names = tuple(name for name, _ in segments)
        self.targeted = tuple(i for i, name in enumerate(self.names) if name in args.target_modules)
        device = base.weight.device
        self.folded_base: torch.Tensor | None = None
        """The base weight, kept while the adapters are folded into `weight` for serving (`fold_adapters`)."""
        self.row_gates: torch.Tensor | None = None
        """Serving base and adapter side by side (`route_adapters`): a buffer whose first rows say, per row of
        the input, 1.0 to add the adapters' output, 0.0 for the base model alone."""
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        for i in self.targeted:
            name = self.names[i]
            self.lora_A[name] = nn.Linear(self.in_features, args.rank, bias=False, device=device, dtype=torch.float32)
            self.lora_B[name] = nn.Linear(args.rank, self.sizes[i], bias=False, device=device, dtype=torch.float32)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init: A kaiming-uniform with a = sqrt(5) (nn.Linear's), B zeros, so the adapter starts at 0."""
        for name in self.lora_A:
            weight = self.lora_A[name].weight
            bound = 1.0 / math.sqrt(weight.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            weight.uniform_(-bound, bound, generator=generator)
            self.lora_B[name].weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.folded_base is not None:  # `weight` already holds base + adapters
            return y
        parts = list(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [y]
        scale: float | torch.Tensor = self.lora.scale
        if self.row_gates is not None:  # per row: the adapters' scale, or 0 for a request of the base model
            rows = x.shape[:-1]
            scale = self.row_gates[: rows.numel()].view(*rows, 1) * self.lora.scale
        for i in self.targeted:
            a, b = self.lora_A[self.names[i]], self.lora_B[self.names[i]]
            h = x.to(a.weight.dtype)
            if self.lora.dropout:
                h = F.dropout(h, self.lora.dropout, self.training)
            parts[i] = parts[i] + (b(a(h)) * scale).to(parts[i].dtype)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def delta_weight(self, name: str) -> torch.Tensor:
        """`scale * B @ A` of projection `name`, fp32, `[rows of the segment, in_features]`."""
        a, b = self.lora_A[name].weight.float(), self.lora_B[name].weight.float()
        return (b @ a) * self.lora.scale

    @torch.no_grad()
    def fold_into_weight(self, base: torch.Tensor) -> None:
        """`weight[segment] = base[segment] + scale * B @ A` for every adapted segment, summed in fp32 and rounded
        once to the weight's dtype (`base` may be `weight` itself)."""
        start = 0
        for i, (proj, size) in enumerate(zip(self.names, self.sizes, strict=True)):
            if i in self.targeted:
                rows = base[start : start + size].float() + self.delta_weight(proj).to(base.device)
                self.weight[start : start + size].copy_(rows)
            start += size

    def fold(self) -> None:
        """Serve folded: `weight` = kept base + adapters (`fold_adapters`)."""
        if self.folded_base is None:
            self.folded_base = self.weight.detach().clone()
        self.fold_into_weight(self.folded_base)

    def merged(self) -> nn.Linear:
        """A plain `nn.Linear` on this module's weight with the adapters folded in (`merge_lora`)."""
        self.fold_into_weight(self.weight if self.folded_base is None else self.folded_base)
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = self.weight
        plain.register_parameter("bias", self.bias)
        return plain

    def adapted_numel(self) -> int:
        """Elements of the base weight the adapters change (what a folding server keeps a copy of)."""
        return self.weight.numel()

    def extra_repr(self) -> str:
        adapted = [self.names[i] for i in self.targeted]
        return f"{super().extra_repr()}, lora_rank={self.lora.rank}, adapted={adapted}"


class LoraExperts(Experts):
    """Routed experts (the same stacked Parameters as the `Experts` it replaces) with one low-rank pair per expert on
    each stacked projection p, laid out as PEFT's `target_parameters` LoRA lays them out, so they save and load 1:1:
    `lora_A[p]` `[E * r, in]` (expert e's A is rows e*r..(e+1)*r) and `lora_B[p]` `[out, r * E]` (column k*E + e is
    rank k of expert e). Expert e's projection is `W[e] + scale * B_e @ A_e`; the MoE backends add it as two thin
    grouped matmuls (`LowRank`), never materialising the sum, unless the adapters are folded for serving."""

    def __init__(self, base: Experts, args: LoraArgs) -> None:
        nn.Module.__init__(self)
        self.activation = base.activation
        for name, param in base.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.lora = args
        self.folded_base: dict[str, torch.Tensor] | None = None
        """The stacked base weights, kept while the adapters are folded into them for serving (`fold_adapters`)."""
        self.row_gates: torch.Tensor | None = None
        """Serving base and adapter side by side (`route_adapters`): one gate per input token, as `LoraLinear`'s."""
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name in self.projections:
            experts, rows, columns = getattr(self, name).shape
            like = {"device": getattr(self, name).device, "dtype": torch.float32}
            self.lora_A[name] = nn.Parameter(torch.zeros(experts * args.rank, columns, **like))
            self.lora_B[name] = nn.Parameter(torch.zeros(rows, args.rank * experts, **like))

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init for a targeted parameter: A as `nn.Linear(in, r * E)`'s kaiming-uniform, B zeros."""
        for name in self.projections:
            weight = self.lora_A[name]
            bound = 1.0 / math.sqrt(weight.shape[1])
            weight.uniform_(-bound, bound, generator=generator)
            self.lora_B[name].zero_()

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Projection `name`'s (A `[E, r, in]`, B `[E, out, r]`), views of the stored adapters (B made contiguous)."""
        experts = getattr(self, name).shape[0]
        a = self.lora_A[name].view(experts, self.lora.rank, -1)
        b = self.lora_B[name].view(-1, self.lora.rank, experts).permute(2, 0, 1).contiguous()
        return a, b

    def low_rank(self, tokens: int) -> LowRank | None:
        if self.folded_base is not None:  # the weights already hold base + adapters
            return None
        first, second = (self.factors(name) for name in self.projections)
        scale: float | torch.Tensor = self.lora.scale
        if self.row_gates is not None:
            scale = self.row_gates[:tokens, None] * self.lora.scale
        return LowRank(first, second, scale)

    @torch.no_grad()
    def fold_into_weight(self, base: Mapping[str, torch.Tensor]) -> None:
        """`W[e] = base[e] + scale * B_e @ A_e` for every expert and projection, summed in fp32 and rounded once to
        the weight's dtype, a few experts at a time (never a whole fp32 stack)."""
        for name in self.projections:
            weight, (a, b) = getattr(self, name), self.factors(name)
            for start in range(0, weight.shape[0], 8):
                part = slice(start, start + 8)
                delta = torch.bmm(b[part].float(), a[part].float()) * self.lora.scale
                weight[part].copy_(base[name][part].float() + delta.to(weight.device))

    def fold(self) -> None:
        if self.folded_base is None:
            self.folded_base = {name: getattr(self, name).detach().clone() for name in self.projections}
        self.fold_into_weight(self.folded_base)

    def merged(self) -> Experts:
        """A plain `Experts` on this module's stacked weights with the adapters folded in (`merge_lora`)."""
        self.fold_into_weight(self.folded_base or {name: getattr(self, name) for name in self.projections})
        experts, rows, hidden = self.w1.shape
        intermediate = rows // 2 if self.activation == "swiglu" else rows
        with torch.device("meta"):
            plain = Experts(experts, hidden, intermediate, self.activation)
        for name in self.projections:
            setattr(plain, name, getattr(self, name))
        return plain

    def adapted_numel(self) -> int:
        return sum(getattr(self, name).numel() for name in self.projections)

    def extra_repr(self) -> str:
        return f"lora_rank={self.lora.rank}, adapted={list(self.projections)}"


LoraModule = LoraLinear | LoraExperts


def _segments(parent: nn.Module, leaf: str, module: nn.Linear) -> tuple[tuple[str, int], ...] | None:
    """The HF projections a runtime projection holds, or None for a module adapters never go on."""
    if leaf == "qkv_proj" and hasattr(parent, "sizes"):
        return tuple(zip(_FUSED[leaf], parent.sizes, strict=True))
    if leaf == "gate_up_proj":
        half = module.out_features // 2
        return (("gate_proj", half), ("up_proj", half))
    if leaf in LORA_TARGETS:
        return ((leaf, module.out_features),)
    return None


def apply_lora(model: nn.Module, args: LoraArgs, *, seed: int | None = None) -> list[str]:
    """Freeze every parameter of `model` and put fp32 adapters on the projections `args.target_modules` names (and,
    with `args.experts`, on every routed experts' stack), in place; returns the runtime names of the modules adapted.
    Call it on a plain `CausalLM` (before activation checkpointing, compile and FSDP). `seed` makes the A init
    reproducible (B is zero)."""
    if any(isinstance(m, LoraLinear | LoraExperts) for m in model.modules()):
        raise LoraError("the model already has LoRA adapters")
    for param in model.parameters():
        param.requires_grad_(False)
    found: list[tuple[str, nn.Module, str, LoraModule]] = []
    for name, module in list(model.named_modules()):
        # A vision tower's projections are not adapted: the targets name the language model's (and per-row
        # gates, serving base and adapter side by side, count text tokens, not image patches).
        if name.split(".", 1)[0] == "visual":
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if type(module) is Experts and args.experts:
            found.append((name, parent, leaf, LoraExperts(module, args)))
            continue
        if type(module) is not nn.Linear or name == "lm_head":
            continue
        segments = _segments(parent, leaf, module)
        if segments and any(s in args.target_modules for s, _ in segments):
            found.append((name, parent, leaf, LoraLinear(module, segments, args)))
    if args.experts and not any(isinstance(wrapped, LoraExperts) for *_, wrapped in found):
        raise LoraError("LoRA on routed experts (experts = true) needs an MoE model; this one has no routed experts")
    if not found:
        raise LoraError(f"no projection of this model matches the LoRA targets {list(args.target_modules)}")
    generator = None
    for _, parent, leaf, wrapped in found:
        device = next(wrapped.parameters()).device
        if generator is None and seed is not None:
            generator = torch.Generator(device).manual_seed(seed)
        if device.type != "meta":
            wrapped.reset_lora_parameters(generator)
        setattr(parent, leaf, wrapped)
    return [name for name, *_ in found]


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraModule]]:
    """Every adapted module (`LoraLinear`, `LoraExperts`) with its runtime name."""
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear | LoraExperts))


def lora_args(model: nn.Module) -> LoraArgs | None:
    """The model's `LoraArgs`, or None without adapters."""
    return next((module.lora for _, module in lora_modules(model)), None)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter weight (`...lora_A.<proj>.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (what an optimizer trains), in module order."""
    return [p for name, p in model.named_parameters() if is_adapter_name(name)]


def clean_name(name: str) -> str:
    """A parameter name without what activation checkpointing, compile or FSDP1 wrapping insert."""
    return _WRAPPERS.sub(r"\1", name).lstrip(".")


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime name -> adapter tensor (detached, not copied) of an unsharded model."""
    return {clean_name(name): p.detach() for name, p in model.named_parameters() if is_adapter_name(name)}


def peft_prefix(model: nn.Module | ModelArgs) -> str:
    """Where transformers keeps the decoder of `model` (or of a model of these args), which PEFT keys follow
    (`model.`, or for vision-language classes `model.language_model.`)."""
    args = model if isinstance(model, ModelArgs) else getattr(model, "args", None)
    return ARCHITECTURES[args.architecture].layout.peft_prefix if args is not None else "model."


def peft_key(runtime_name: str, prefix: str = "model.") -> str:
    """The PEFT key of an adapter tensor: `layers.0.self_attn.qkv_proj.lora_A.q_proj.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (`prefix`: `peft_prefix`). Expert adapters
    follow PEFT's nesting of two targeted parameters on one module (the first projection, registered first, is
    wrapped innermost): `layers.0.mlp.experts.lora_A.gate_up_proj` -> `base_model.model.model.layers.0.mlp.experts
    .base_layer.lora_A.weight`, `...lora_A.down_proj` -> `...mlp.experts.lora_A.weight`."""
    name = clean_name(runtime_name)
    if match := _EXPERT_ADAPTER.match(name):
        inner = "" if match["param"] == "down_proj" else "base_layer."
        return f"{PEFT_PREFIX}{prefix}{match['module']}.{inner}lora_{match['ab']}.weight"
    match = _ADAPTER.match(name)
    if match is None:
        raise LoraError(f"{runtime_name} is not an adapter weight name")
    return f"{PEFT_PREFIX}{prefix}{match['module']}.{match['proj']}.lora_{match['ab']}.weight"


def to_peft_state_dict(
    adapters: Mapping[str, torch.Tensor] | nn.Module, prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor, from runtime adapter tensors (or an unsharded model's, under its own prefix)."""
    if isinstance(adapters, nn.Module):
        prefix = peft_prefix(adapters)
        adapters = adapter_state_dict(adapters)
    return {peft_key(name, prefix): tensor for name, tensor in adapters.items()}


def from_peft_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime name -> tensor for `model`'s adapters from a PEFT state dict (keys with or without PEFT's
    `base_model.model.` prefix and adapter name); LoraError naming the missing and unexpected keys."""
    prefix = peft_prefix(model)
    wanted = {peft_key(name, prefix): name for name in adapter_state_dict(model)}
    out, unexpected = {}, []
    for key, tensor in tensors.items():
        plain = re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", key) if key not in wanted else key
        if plain not in wanted and not plain.startswith(PEFT_PREFIX):
            plain = PEFT_PREFIX + plain
        if plain in wanted:
            out[wanted[plain]] = tensor
        else:
            unexpected.append(key)
    missing = sorted(k for k, name in wanted.items() if name not in out)
    if missing or unexpected:
        raise LoraError(
            f"the adapter does not match the model's LoRA layout: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:5]} ({len(unexpected)})"
        )
    return out


def peft_config(
    args: LoraArgs, base_model_name: str = "", target_parameters: list[str] | None = None
) -> dict[str, Any]:
    """`adapter_config.json` as PEFT 0.21 writes it for `LoraConfig(r, lora_alpha, lora_dropout, target_modules,
    target_parameters, task_type="CAUSAL_LM")` of a saved (inference-mode) PeftModel; `target_parameters` names the
    adapted expert stacks (`experts.gate_up_proj`, `experts.down_proj`)."""
    alpha = int(args.alpha) if float(args.alpha).is_integer() else args.alpha
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name or None,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": args.dropout,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": args.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(args.target_modules),
        "target_parameters": target_parameters or None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": False,
        "velora_config": None,
    }


def write_adapter(
    path: str | Path,
    adapters: Mapping[str, torch.Tensor],
    args: LoraArgs,
    *,
    base_model_name: str = "",
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
) -> Path:
    """Write a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) from runtime adapter
    tensors (`adapter_state_dict`, or gathered from FSDP shards), atomically as `save_model` writes; `prefix`: the
    model's `peft_prefix`."""
    path = Path(path)
    peft = to_peft_state_dict(adapters, prefix)
    tensors = {key: t.detach().to("cpu", dtype).contiguous().clone() for key, t in peft.items()}
    experts = (_EXPERT_ADAPTER.match(clean_name(name)) for name in adapters)
    target_parameters = sorted({f"experts.{match['param']}" for match in experts if match})
    _remove_interrupted_saves(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        config = peft_config(args, base_model_name, target_parameters)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_adapter(
    model: nn.Module, path: str | Path, *, base_model_name: str = "", dtype: torch.dtype | None = None
) -> Path:
    """Write an unsharded model's adapters as a PEFT adapter directory (`base_model_name`: what PEFT records as
    `base_model_name_or_path`, default the model's source directory)."""
    args = lora_args(model)
    if args is None:
        raise LoraError("the model has no LoRA adapters to save")
    name = base_model_name or str(getattr(model, "source_dir", "") or "")
    return write_adapter(
        path, adapter_state_dict(model), args, base_model_name=name, dtype=dtype, prefix=peft_prefix(model)
    )


_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
}
_PEFT_FACTOR = re.compile(r"\.lora_(?P<ab>[AB])(\.[^.]+)?\.weight$")
"""A PEFT adapter key's factor (`...lora_A.weight`, or with the adapter's name `...lora_A.default.weight`)."""
_PEFT_EXPERTS = re.compile(r"\.experts\.(base_layer\.)?lora_[AB]\.")
"""A PEFT key of stacked routed experts, whose rank dimension holds E * r (`LoraExperts`)."""


@dataclass(frozen=True)
class AdapterConfig:
    """What a PEFT adapter's `adapter_config.json` says that tandem uses (`read_adapter_config`)."""

    args: LoraArgs
    base_model: str
    """`base_model_name_or_path` ('' when unset)."""


def _shown(value: object) -> str:
    """A value of a config for a message: its repr, cut short (a config may hold anything)."""
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= 60 else f"{text[:57]}..."


def _expert_targets(config_file: Path, target_parameters: object) -> bool:
    """Whether a PEFT config's `target_parameters` adapt the routed experts (both stacked projections, which is
    what tandem runs); LoraError for any other parameter target."""
    if not target_parameters:
        return False
    names = [target_parameters] if isinstance(target_parameters, str) else target_parameters
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise LoraError(f"{config_file}: target_parameters must be a list of names, got {_shown(target_parameters)}")
    params = set()
    for name in names:
        module, _, param = name.rpartition(".")
        if param not in EXPERT_PARAMETERS or module.rpartition(".")[2] != "experts":
            raise LoraError(
                f"{config_file}: target_parameters {_shown(name)} is not supported; tandem adapts the routed "
                f"experts' stacked projections ({', '.join('experts.' + p for p in EXPERT_PARAMETERS)})"
            )
        params.add(param)
    if "down_proj" not in params or not params & {"gate_up_proj", "up_proj"}:
        raise LoraError(
            f"{config_file}: target_parameters {names} adapt one expert projection; tandem adapts both (the first "
            "projection and down_proj) or neither"
        )
    return True


def _target_modules(config_file: Path, targets: object, experts: bool) -> tuple[str, ...]:
    """The projections a PEFT config's `target_modules` (a list of names, one name, or `all-linear`) adapt."""
    if isinstance(targets, str):
        targets = list(LORA_TARGETS) if targets == "all-linear" else [targets]
    if experts and not targets:
        return ()
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{config_file}: target_modules must be a list of projection names, got {_shown(targets)}")
    if unknown := sorted(set(targets) - set(LORA_TARGETS)):
        raise LoraError(f"{config_file}: targets {unknown} are not supported; tandem adapts {', '.join(LORA_TARGETS)}")
    return tuple(t for t in LORA_TARGETS if t in targets)


def _number(config_file: Path, key: str, value: object, *, integer: bool = False) -> Any:
    """`value` of `key` if it is a JSON number (an integer where `integer`), else LoraError naming the key."""
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise LoraError(f"{config_file}: {key} must be {kind}, got {_shown(value)}")
    if integer:
        return value
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        raise LoraError(f"{config_file}: {key} = {_shown(value)} is beyond any float") from None


def _parse_adapter_config(config_file: Path, config: object) -> AdapterConfig:
    """The explicit checks of a parsed `adapter_config.json`: every key tandem reads has the type PEFT writes, and
    what tandem does not compute is refused by name."""
    if not isinstance(config, dict):
        raise LoraError(f"{config_file} must hold a JSON object (PEFT's LoraConfig), not {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{config_file}: only PEFT LoRA adapters load (peft_type LORA)")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value != default and value not in (None, False, [], {}):
            raise LoraError(f"{config_file}: {key} = {_shown(value)} is not supported (only {default!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"{config_file}: {key} (per-module ranks or alphas) is not supported")
    if "r" not in config:
        raise LoraError(f"{config_file} has no `r` (the adapter's rank)")
    experts = _expert_targets(config_file, config.get("target_parameters"))
    base_model = config.get("base_model_name_or_path") or ""
    if not isinstance(base_model, str):
        raise LoraError(f"{config_file}: base_model_name_or_path must be a string, got {_shown(base_model)}")
    dropout = config.get("lora_dropout")
    try:
        args = LoraArgs(
            rank=_number(config_file, "r", config["r"], integer=True),
            alpha=_number(config_file, "lora_alpha", config.get("lora_alpha", 8)),
            dropout=0.0 if dropout is None else _number(config_file, "lora_dropout", dropout),
            target_modules=_target_modules(config_file, config.get("target_modules"), experts),
            experts=experts,
        )
    except LoraError as error:
        message = str(error)
        raise LoraError(message if message.startswith(str(config_file)) else f"{config_file}: {message}") from None
    return AdapterConfig(args, base_model)


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """The one reader of a PEFT adapter directory's `adapter_config.json`: at most `ADAPTER_CONFIG_BYTES`, a JSON
    object whose keys have the types PEFT writes, and settings tandem runs (`LoraArgs`' bounds on rank, alpha and
    scale included); LoraError naming the file and the key otherwise (DoRA, rsLoRA, per-module ranks,
    modules_to_save, bias, a missing or malformed `r`, ...)."""
    config_file = Path(path) / ADAPTER_CONFIG
    try:
        with open(config_file, "rb") as handle:
            raw = handle.read(ADAPTER_CONFIG_BYTES + 1)
    except OSError as error:
        raise LoraError(f"{config_file} is not readable: {error.strerror or error}") from None
    if len(raw) > ADAPTER_CONFIG_BYTES:
        raise LoraError(f"{config_file} is over {ADAPTER_CONFIG_BYTES} bytes; PEFT writes about 2 KB")
    try:
        config = json.loads(raw)
    except RecursionError:
        raise LoraError(f"{config_file} is not an adapter config: its JSON nests too deep") from None
    except ValueError as error:
        raise LoraError(f"{config_file} is not valid JSON: {error}") from None
    return _parse_adapter_config(config_file, config)


def check_adapter_tensors(weights: Path, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """LoraError unless every tensor of a PEFT adapter file is a 2-D float matrix of the config's rank `r` (r rows
    of A and r columns of B; E * r for stacked experts), with finite values: an integer adapter would be cast to
    a no-op, and a NaN reaches every answer."""
    for key, tensor in tensors.items():
        if tensor.dtype not in ADAPTER_DTYPES:
            dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in ADAPTER_DTYPES)
            raise LoraError(f"{weights}: {key} is {str(tensor.dtype).removeprefix('torch.')}, not one of {dtypes}")
        if tensor.dim() != 2:
            raise LoraError(f"{weights}: {key} has shape {tuple(tensor.shape)}, not a matrix")
        if factor := _PEFT_FACTOR.search(key):
            size = tensor.shape[0] if factor["ab"] == "A" else tensor.shape[1]
            if (size % rank if _PEFT_EXPERTS.search(key) else size != rank) or not size:
                raise LoraError(
                    f"{weights}: {key} has shape {tuple(tensor.shape)}, not that of rank {rank} ({ADAPTER_CONFIG}'s r)"
                )
        if not all_finite(tensor):
            raise LoraError(f"{weights}: {key} holds NaN or infinite values")


def read_adapter(path: str | Path) -> tuple[LoraArgs, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory's `LoraArgs` and tensors (PEFT keys), both checked
    (`read_adapter_config`, `check_adapter_tensors`): the one loader of adapter files, for serving at start-up
    and by `/update_weights` (either engine), for `tandem merge-lora` and `load_peft_adapter`."""
    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise LoraError(f"{path} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    args = read_adapter_config(path).args
    try:
        tensors = load_file(weights)
    except Exception as error:  # SafetensorError has no importable base besides Exception
        raise LoraError(f"{weights} is not readable safetensors: {error}") from None
    check_adapter_tensors(weights, args.rank, tensors)
    return args, tensors


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str | Path) -> LoraArgs:
    """Load a PEFT LoRA adapter directory into an unsharded model: adapters are added first (`apply_lora`) when
    the model has none, else they must have the same rank and targets. Returns the adapter's `LoraArgs`."""
    args, tensors = read_adapter(path)
    current = lora_args(model)
    if current is None:
        apply_lora(model, args)
    elif current.layout[0] != args.layout[0] or current.layout[2:] != args.layout[2:]:  # alpha may differ
        raise LoraError(f"adapter {path} has {args}; the model's adapters {current}")
    params = dict(model.named_parameters())
    by_clean = {clean_name(name): name for name in params if is_adapter_name(name)}
    for name, tensor in from_peft_state_dict(model, tensors).items():
        param = params[by_clean[name]]
        if tuple(tensor.shape) != tuple(param.shape):
            raise LoraError(
                f"adapter {path}: {peft_key(name, peft_prefix(model))} has shape {tuple(tensor.shape)}, the model "
                f"{tuple(param.shape)}"
            )
        param.copy_(tensor)
    if current is not None and current != args:
        for _, module in lora_modules(model):
            module.lora = args
    return args


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (`W[segment] += scale * B @ A`, summed in fp32 and rounded once to
    the weight's dtype) and put the plain modules back, in place; returns the model, which then has no adapters."""
    for name, module in list(lora_modules(model)):
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, module.merged())
    return model


@torch.no_grad()
def fold_adapters(model: nn.Module) -> None:
    """Serve the adapters folded: each adapted weight becomes `base + scale * B @ A` (from a copy of the base kept
    on the module the first time), and the forward is the plain projection again, so decode runs at the base
    model's speed and through kernels that read `.weight` alone. Call it again after the adapters change (a
    hand-off): every fold starts from the kept base, so rounding never accumulates. Costs one more copy of the
    adapted weights in memory; the weights keep their storage (CUDA graphs stay valid)."""
    for _, module in lora_modules(model):
        module.fold()


def route_adapters(model: nn.Module, gates: torch.Tensor) -> None:
    """Serve base and adapter side by side from unfolded adapters: every adapted projection scales its adapters'
    output for input row r by `gates[r]` (1.0: the adapter's request, 0.0: the base model's). `gates` is a buffer
    at least as long as any forward's rows, written before each forward; CUDA graphs read it at its address."""
    if lora_folded(model):
        raise LoraError("folded adapters are part of the weights: the base model cannot be served beside them")
    for _, module in lora_modules(model):
        module.row_gates = gates


def lora_folded(model: nn.Module) -> bool:
    """Whether the model serves folded adapters (`fold_adapters`), which must be folded again after a change."""
    return any(module.folded_base is not None for _, module in lora_modules(model))
