"""The model as the trainer runs it: loaded or random, activation checkpointing, compiled, FSDP2-sharded."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from tandem.config import ConfigError
from tandem.config.common import ModelConfig
from tandem.models import ModelArgs, ModelRuntime, build_model, load_model, model_args, save_model
from tandem.models.checkpoint import INDEX_FILE
from tandem.models.lora import (
    LoraArgs,
    LoraError,
    apply_lora,
    is_adapter_name,
    lora_args,
    peft_prefix,
    write_adapter,
)
from tandem.trainer.expert_parallel import apply_expert_parallel
from tandem.trainer.metrics import flops_per_token
from tandem.trainer.parallel import DTYPES, World, full_tensors, shard_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    args: ModelArgs
    source_dir: Path
    vocab_size: int
    num_params: int
    flops_per_token: float


def runtime_options(config: ModelConfig, freeze_router_default: bool) -> dict:
    """The `ModelRuntime` fields the `[model]` section sets."""
    freeze = config.freeze_router
    return {
        "attn_backend": config.attn_backend,
        "moe_backend": config.moe_backend,
        "freeze_router": freeze_router_default if freeze is None else freeze,
    }


def active_params(model: torch.nn.Module, args: ModelArgs) -> int:
    """Non-embedding parameters one token uses: MoE layers count only the top-k experts."""
    total = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if args.tie_word_embeddings:
        total += args.vocab_size * args.hidden_size  # the LM head still does its matmul
    if args.moe is not None:
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        total -= experts * (args.moe.num_experts - args.moe.top_k) // args.moe.num_experts
    return total


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Run `model`'s forward under torch.autocast(`dtype`): fp32 weights, matmuls in `dtype`, no FSDP needed."""
    if dtype == torch.float32:
        return
    forward = model.forward

    @functools.wraps(forward)
    def autocast(*args, **kwargs):
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast


def read_model_args(config) -> ModelArgs:
    """The architecture in `model.name`'s config.json, after checking what loading the model will read: the
    directory, a config.json tandem runs and, unless `random_init`, its weights. A mistake is a ConfigError
    naming the path, raised before anything is built or allocated."""
    if not config.model.name:
        raise ConfigError(
            "set model.name to a Hugging Face model directory (config.json, and weights unless random_init)"
        )
    source = Path(config.model.name)
    if not source.exists():
        raise ConfigError(f"model.name {source}: no such directory")
    if not (source.is_dir() or config.random_init):
        raise ConfigError(f"model.name {source} is not a directory (a config.json alone needs random_init = true)")
    try:
        args = model_args(source)
    except (ValueError, OSError) as error:  # the models' ConfigError, unreadable or malformed JSON
        raise ConfigError(f"model.name {source}: {error}") from None
    if not config.random_init and not (any(source.glob("*.safetensors")) or (source / INDEX_FILE).is_file()):
        raise ConfigError(
            f"model.name {source} holds no weights (*.safetensors): point it at a checkpoint, "
            "or set random_init = true to start from random weights"
        )
    return args


def build_training_model(
    config, world: World, *, shard: bool = True, **runtime_extra
) -> tuple[torch.nn.Module, ModelInfo]:
    """fp32 master weights on the device, blocks wrapped for AC and compile, then fully_shard.

    `shard=False` (one process only) skips FSDP2 and runs the forward under autocast instead.
    `runtime_extra`: more `tandem.models.ModelRuntime` fields from the command's config (kernels, routing).
    """
    source_args = read_model_args(config)
    source = Path(config.model.name)
    runtime = ModelRuntime(**runtime_options(config.model, config.command == "trainer"), **runtime_extra)
    lora = check_lora(config, source_args)
    # With LoRA the frozen base is held in the compute dtype (no fp32 masters to update); adapters are fp32.
    dtype = DTYPES[config.model.dtype] if lora is not None else torch.float32
    if config.random_init:
        model = build_model(source, dtype=dtype, device=world.device, seed=config.seed, runtime=runtime)
    else:
        model = load_model(source, dtype=dtype, device=world.device, runtime=runtime)
    if lora is not None:
        apply_lora(model, lora, seed=config.seed)
    args: ModelArgs = model.args
    info = ModelInfo(
        args=args,
        source_dir=source,
        vocab_size=args.vocab_size,
        num_params=sum(p.numel() for p in model.parameters()),
        flops_per_token=flops_per_token(
            active_params(model, args), args.num_layers, args.num_heads, args.head_dim, config.seq_len
        ),
    )
    if config.model.expert_parallel > 1:
        if config.compile and config.fullgraph:
            raise ConfigError(
                "model.expert_parallel needs fullgraph = false with compile = true: the all-to-all splits depend "
                "on the routing, so the MoE layers break the graph"
            )
        apply_expert_parallel(model, config.model.expert_parallel)
    for index, block in enumerate(model.layers):
        wrap = config.activation_checkpointing == "full" or (
            config.activation_checkpointing == "selective" and index % 2 == 0
        )
        if config.compile:
            block.compile(fullgraph=config.fullgraph)
        if wrap:
            # LoRA dropout draws random masks inside the block: the recompute must draw the same ones
            preserve = lora is not None and lora.dropout > 0
            model.layers[index] = checkpoint_wrapper(block, preserve_rng_state=preserve)
    if shard or world.world_size > 1:
        shard_model(model, config.model.dtype)
    else:
        autocast_forward(model, DTYPES[config.model.dtype], world.device)
    if world.is_main:
        logger.info(
            "model: %s, %.1fM parameters, compute in %s, activation checkpointing %s, compile %s, expert parallel %d",
            args.architecture,
            info.num_params / 1e6,
            config.model.dtype,
            config.activation_checkpointing,
            config.compile,
            config.model.expert_parallel,
        )
        if lora is not None:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            logger.info(
                "LoRA: %s, dropout %g; %.2fM trainable parameters, base frozen in %s",
                lora,
                lora.dropout,
                trainable / 1e6,
                config.model.dtype,
            )
    return model, info


def check_lora(config, args: ModelArgs) -> LoraArgs | None:
    """The `LoraArgs` of `[model.lora]` for the model `args`, or None when it is off; ConfigError for what LoRA does
    not run with yet."""
    section = config.model.lora
    if not section.enabled:
        return None
    if config.model.expert_parallel > 1:
        raise ConfigError("model.lora does not run with model.expert_parallel > 1 yet; set model.expert_parallel = 1")
    if section.experts and args.moe is None:
        raise ConfigError(f"model.lora.experts = true needs an MoE model; {config.model.name} has no routed experts")
    try:
        return LoraArgs.of(section)
    except LoraError as error:
        raise ConfigError(f"model.lora: {error}") from None


def export_hf(model: torch.nn.Module, info: ModelInfo, path: Path, world: World, dtype: str) -> None:
    """Gather the full weights and write a Hugging Face directory from rank 0; with LoRA, the PEFT adapter
    directory instead (`export_adapter`)."""
    if lora_args(model) is not None:
        export_adapter(model, info, path, world)
        return
    state = {name: tensor.cpu() for name, tensor in full_tensors(model) if world.is_main}
    if world.is_main:
        export = build_model(info.args, device="meta")
        export.load_state_dict(state, assign=True, strict=True)
        save_model(export, path, dtype=DTYPES[dtype], tokenizer_dir=info.source_dir)
        logger.info("saved Hugging Face checkpoint %s", path)
    if dist.is_initialized():
        dist.barrier()


def gather_adapters(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor]:
    """Runtime name -> whole fp32 adapter tensor on the CPU, on rank 0 (empty elsewhere). Collective: only the
    adapters are gathered, never the frozen base."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    adapters = {}
    for name, value in state.items():
        if not is_adapter_name(name):
            continue
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if world.is_main:
            adapters[name] = whole.detach().float().cpu()
    return adapters


def export_adapter(model: torch.nn.Module, info: ModelInfo, path: Path, world: World) -> None:
    """Write the adapters as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`, fp32)
    from rank 0; `peft.PeftModel.from_pretrained(base, path)` loads it, `tandem merge-lora` merges it."""
    args = lora_args(model)
    adapters = gather_adapters(model, world)
    if world.is_main and args is not None:
        write_adapter(path, adapters, args, base_model_name=str(info.source_dir), prefix=peft_prefix(info.args))
        logger.info("saved LoRA adapter (PEFT format) %s", path)
    if dist.is_initialized():
        dist.barrier()
