"""Sections every command shares, and the root config that flows shared values into process sections."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import Section
from tandem.config.loader import deep_merge

Dtype = Literal["float32", "bfloat16", "float16"]
MoeBackend = Literal["loop", "grouped_mm"]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face projection names LoRA adapters may target (attention, then dense MLP / shared experts)."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA), saved and loaded in PEFT's format (docs/lora.md)."""

    rank: int = Field(0, ge=0)
    """Adapter rank r (0: off, full fine-tuning). On: only the adapters train; the base weights stay frozen in model.dtype."""
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False)
    """Scaling numerator: the adapter's output is multiplied by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on each adapter's input during training (PEFT's `lora_dropout`)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Projections to adapt, by Hugging Face name (default: every attention and MLP projection): any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""
    experts: bool = False
    """Adapters on the routed experts of MoE layers too: a rank-r pair per expert on each stacked projection (PEFT's `target_parameters` experts.gate_up_proj / experts.down_proj). Shared experts and dense MLPs are adapted by gate_proj/up_proj/down_proj either way."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {', '.join(unknown)}; valid: {', '.join(LORA_TARGETS)}")
        if not value:
            raise ValueError(f"name at least one LoRA target of: {', '.join(LORA_TARGETS)}")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _no_dropout_on_experts(self) -> LoraConfig:
        if self.experts and self.dropout:
            raise ValueError(
                "dropout applies to an adapter's input, which routed experts' adapters share with their stacked "
                "weights (PEFT refuses it there too): set dropout = 0 with experts = true"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LoadedModelConfig(Section):
    """Which model to load and how it computes: all a server of it needs (`tandem eval` takes only this)."""

    name: str = ""
    """Hugging Face model directory (config.json + safetensors + tokenizer files) or Hub id (`Qwen/Qwen3-0.6B`, fetched into the Hugging Face cache once)."""
    revision: str = ""
    """With a Hub id: the branch, tag or commit to fetch (default: main)."""
    dtype: Dtype = "bfloat16"
    """Parameter dtype the model runs in."""
    attn_backend: Literal["auto", "sdpa", "flex"] = "auto"
    """Attention kernel: sdpa (any device), flex (GPU; packed documents without a dense mask), or auto."""
    moe_backend: MoeBackend | list[MoeBackend] = "grouped_mm"
    """MoE expert compute, one name for every layer or a list with one per layer."""

    @model_validator(mode="before")
    @classmethod
    def _name_shorthand(cls, data: Any) -> Any:
        """`--model ./dir` and `model = "dir"` mean `model.name`."""
        return {"name": data} if isinstance(data, str) else data


class ModelConfig(LoadedModelConfig):
    """The model to train or serve: what loading it takes, and how it trains (router, expert sharding, LoRA)."""

    freeze_router: bool | None = None
    """Stop gradients into MoE routers (default: on in RL, so expert choices match inference; off in SFT)."""
    expert_parallel: int = Field(1, ge=1)
    """Trainer: split each MoE layer's experts over this many ranks, tokens sent to them by all-to-all (1: FSDP shards experts like every other weight). Divides the trainer's world size and the number of experts."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (`--model.lora.rank 8`)."""


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Console and log-file verbosity."""


class RunConfig(Section):
    """The root of every command's config.

    `shared_fields` are set once at the top level and flow into every process
    section that declares the same field, unless that section sets it itself
    (tables are merged key by key, section keys winning).
    """

    command: ClassVar[str] = "run"
    shared_fields: ClassVar[tuple[str, ...]] = ("model", "seq_len", "output_dir", "run_name", "log")

    model: ModelConfig = ModelConfig()
    """The model to train, serve or evaluate."""
    seq_len: int = Field(2048, gt=0)
    """Maximum tokens per sequence (prompt plus completion)."""
    output_dir: Path = Path("outputs")
    """Directory that holds one folder per run."""
    run_name: str = ""
    """Folder name of this run under output_dir (default: `<command>-<date>-<time>`)."""
    log: LogConfig = LogConfig()
    """Logging."""

    @model_validator(mode="before")
    @classmethod
    def _flow_shared_values(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not data.get("run_name"):
            data["run_name"] = f"{cls.command}-{datetime.now():%Y%m%d-%H%M%S}"
        for name, info in cls.model_fields.items():
            if isinstance(info.default, Section):
                data[name] = _under_default(info.default, data.get(name))
            target = info.annotation
            if not (isinstance(target, type) and issubclass(target, RunConfig)):
                continue
            section = dict(data.get(name) or {})
            for key in cls.shared_fields:
                if key not in data or key not in target.model_fields:
                    continue
                value = data[key]
                field_type = target.model_fields[key].annotation
                if isinstance(value, Section):
                    value = value.model_dump(exclude_unset=True)
                elif isinstance(field_type, type) and issubclass(field_type, Section) and not isinstance(value, dict):
                    value = field_type.model_validate(value).model_dump(exclude_unset=True)
                own = section.get(key)
                if isinstance(value, dict) and isinstance(own, dict):
                    section[key] = deep_merge(value, own)
                elif own is None:
                    section[key] = value
            data[name] = section
        return data

    @field_validator("run_name")
    @classmethod
    def _one_path_component(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise ValueError("must be a single folder name of letters, digits, '.', '_' and '-'")
        return value

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_name


def _under_default(default: Section, given: Any) -> Any:
    """A section's values over the non-class defaults its field declares (`optim = OptimConfig(lr=1e-6)`),
    so setting one key of such a section keeps the field's other defaults. Shared values are left to flow."""
    if given is not None and not isinstance(given, dict):
        return given
    shared = default.shared_fields if isinstance(default, RunConfig) else ()
    base = {k: v for k, v in default.model_dump(exclude_unset=True).items() if k not in shared}
    return deep_merge(base, given or {})


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""


class SchedulerConfig(Section):
    type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to the peak learning rate."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of linear/cosine decay, as a fraction of the peak."""
