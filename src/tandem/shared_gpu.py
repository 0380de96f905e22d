"""One GPU, two processes: how `tandem rl` splits a GPU that its trainer and inference server(s) share.

With neither `deploy.trainer_gpus` nor `deploy.inference_gpus` set, trainer rank 0 and every inference server
run on GPU 0 and start at the same time. Each would size itself against whatever is free when it looks, so the
split would depend on which one allocates first. Instead the launcher plans the split before starting either:

- the trainer keeps `deploy.trainer_memory_gib`, or by default an estimate (`trainer_need`): fp32 master weights,
  gradients and AdamW's two moments (16 bytes a parameter, divided over FSDP ranks), the bf16 copies forward and
  backward compute with (2 bytes a parameter), the shared hand-off buffer (the policy in its dtype) when weights
  go over CUDA IPC, the activations of one micro-batch (`orchestrator.micro_batch_rows` x `seq_len` tokens;
  fewer when the blocks are compiled), the chunked loss's temporaries (one chunk of logits in the compute dtype
  with the fused loss, several fp32 ones without), and slack for the CUDA context and the allocator's
  fragmentation. AdamW's step
  runs after backward has freed the activations, so its foreach temporaries count only when larger;
  With LoRA (`model.lora`) only the adapters count so (and travel, in fp32); the frozen base is held once, in
  the compute dtype;
- each server gets its CUDA context, its weights in the serving dtype (with LoRA: and the fp32 adapters, and a
  copy of the adapted weights when it folds them, `inference.lora_fold`), a hybrid model's recurrent-state cache
  (a slot per running sequence), the engine's own estimate of one step's
  temporaries (`kv_budget.activation_bytes`) and a KV cache of at least one `seq_len` sequence, and then the
  rest of the GPU, up to room for `max_running` sequences of `seq_len` tokens (more could never be used);
- what is left stays free, as headroom for the trainer.

The server's share becomes `inference.gpu_memory_utilization` (vLLM's meaning: this server's share of the
whole GPU) and, for the built-in engine, an exact `inference.kv_cache_blocks`: the built-in engine otherwise
sizes its cache from the memory free when it starts, which counts whatever the trainer has allocated by then.
A utilisation (other than the default 0.9) or a block count the user set wins and is only checked; a plan
that cannot fit is a ConfigError naming the numbers before anything starts.

The GPU's size is read in a short-lived child process: creating a CUDA context in the launcher would hold
about half a GiB of the shared GPU for the whole run.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.config.common import LoraConfig
from tandem.config.inference import InferenceConfig
from tandem.config.rl import RlConfig
from tandem.inference.kv_budget import activation_bytes, block_bytes, state_bytes, state_slots
from tandem.models import ModelArgs, build_model, model_args
from tandem.models.lora import LoraArgs, apply_lora, lora_modules, lora_parameters
from tandem.trainer.parallel import DTYPES

logger = logging.getLogger(__name__)

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB
"""Per process, outside torch's allocator: the CUDA context, cuBLAS workspaces and loaded kernels."""
FRAGMENTATION = 0.10
"""The allocator's slack over the trainer's estimated allocations (blocks rounded up, cached, fragmented)."""
STATE_BYTES = 16
"""Per parameter: fp32 master weight, fp32 gradient, AdamW's exp_avg and exp_avg_sq in fp32."""
COMPUTE_COPY_BYTES = 2
"""Per parameter: the bf16 copy matmuls use (FSDP's unsharded parameters, or autocast's cast cache)."""
OPTIMIZER_TEMP_BYTES = 4
"""Per parameter: foreach AdamW's step forms sqrt(exp_avg_sq) of every parameter at once."""
LOGIT_TEMPORARIES = 4
"""fp32 `[chunk, vocab]` tensors the chunked loss holds at once in backward (logits, probabilities, their
gradient, and the kept mask)."""
FUSED_LOGIT_TEMPORARIES = 2
"""`[chunk, vocab]` tensors in the compute dtype the fused policy loss holds at once: the chunk's logits, which
its gradient overwrites in place, and the compiled softmax kernels' outputs."""
GPU_QUERY_TIMEOUT_S = 120.0
DEFAULT_UTILIZATION = InferenceConfig.model_fields["gpu_memory_utilization"].default
"""Its default counts as unset even when written out (a run's saved, fully resolved config loaded back)."""

_GPU_QUERY = (
    "import json, torch\n"
    "p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None\n"
    "print(json.dumps(p and {'name': p.name, 'total': p.total_memory}))\n"
)


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int


@dataclass(frozen=True)
class TrainerNeed:
    """Bytes trainer rank 0 needs on the shared GPU, by what holds them."""

    states: int
    """fp32 weights, gradients and AdamW state (rank 0's shard)."""
    compute_copies: int
    handoff: int
    """The shared weight hand-off buffer (CUDA IPC), 0 for the other transports."""
    activations: int
    loss: int
    optimizer_temporaries: int
    slack: int

    @property
    def total(self) -> int:
        step = max(self.compute_copies + self.activations + self.loss, self.optimizer_temporaries)
        return self.states + self.handoff + step + self.slack


@dataclass(frozen=True)
class ServerNeed:
    """Bytes one inference server needs besides its KV cache, and the size of one cache block."""

    context: int
    weights: int
    activations: int
    block: int
    state: int = 0
    """A hybrid model's recurrent-state cache (a slot per running sequence), allocated beside the KV cache."""

    @property
    def fixed(self) -> int:
        return self.context + self.weights + self.activations + self.state


def shares_gpu(config: RlConfig) -> bool:
    """Whether trainer rank 0 and the inference servers land on the same GPU (GPU 0 of those visible)."""
    deploy = config.deploy
    return not (deploy.trainer_gpus or deploy.inference_gpus) and config.inference.device in ("auto", "cuda", "cuda:0")


def query_gpu() -> Gpu | None:
    """GPU 0's name and memory (as CUDA_VISIBLE_DEVICES shows it), read in a child process so that this one never
    holds a CUDA context; None without CUDA (or when the query fails, which is logged)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _GPU_QUERY], capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True
        )
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as error:
        logger.warning("could not read the GPU's memory (%s); the shared GPU is not split", error)
        return None
    return None if found is None else Gpu(found["name"], int(found["total"]))


def split_shared_gpu(config: RlConfig) -> tuple[RlConfig, str | None]:
    """The launcher's entry: on a GPU that trainer and inference share, the planned config and the sentence to
    log; else the config unchanged and None. Call it before the child configs are written."""
    if not shares_gpu(config) or not torch.cuda.is_available():  # no CUDA context: a driver query only
        return config, None
    gpu = query_gpu()
    if gpu is None:
        return config, None
    return plan_shared_gpu(config, gpu.total_bytes, gpu.name)


@dataclass(frozen=True)
class ParameterCounts:
    """A model's parameters, counted on the meta device (tied embeddings once, MoE experts all)."""

    base: int
    adapters: int = 0
    """LoRA adapter parameters (what trains, in fp32, and what a hand-off moves)."""
    adapted: int = 0
    """Base parameters under adapters: what a server folding them (`inference.lora_fold`) keeps a copy of."""


def parameter_counts(args: ModelArgs, lora: LoraConfig) -> ParameterCounts:
    model = build_model(args, device="meta")
    base = sum(p.numel() for p in model.parameters())
    if not lora.enabled:
        return ParameterCounts(base)
    apply_lora(model, LoraArgs.of(lora, dropout=0.0))
    adapters = sum(p.numel() for p in lora_parameters(model))
    return ParameterCounts(base, adapters, sum(module.adapted_numel() for _, module in lora_modules(model)))


def activation_bytes_per_token(args: ModelArgs, checkpointing: str, compiled: bool = False) -> float:
    """Bytes a token of a micro-batch holds at the peak, the start of backward: what autograd saved, and one
    block's worth more (backward's gradients of one block at a time, or its recomputation when checkpointed).

    A decoder block saves about 20 h + 8 I + 12 (q + kv) bytes a token under bf16 autocast (h hidden, I the MLP's
    intermediate size, q and kv the query and key/value widths): counted from the tensors autograd saves for
    backward in a real block (tests/test_shared_gpu.py checks it). A MoE block saves k (8 I_e + 8 h) + 8 E for its
    MLP instead of 8 I (top-k copies of each token through experts of width I_e, router logits over E experts).
    A checkpointed block keeps only its fp32 input (4 h). Outside the blocks: the embedding output, the final
    norm, the hidden states the loss saves and their gradient (16 h), and a few fp32 scalars a token.

    `compiled` (trainer.compile): inductor saves the bf16 inputs of each pointwise chain and recomputes the chain
    in backward, so a dense block keeps its fp32 residuals and their bf16 norms (12 h), q and k before and after
    their norm and RoPE, v and the attention output (6 (q + kv)), and the gate/up projection with its SwiGLU
    (6 I): about 0.6x of eager at Qwen3's shapes (benchmarks/RESULTS.md compares it with measured peaks)."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attention = 12 * h + 6 * (q + kv) if compiled else 20 * h + 12 * (q + kv)
    blocks: list[float] = []
    for layer in range(args.num_layers):
        if args.is_moe_layer(layer):
            moe = args.moe
            mlp = moe.top_k * (8 * moe.intermediate_size + 8 * h) + 8 * moe.num_experts
        else:
            mlp = (6 if compiled else 8) * args.intermediate_size
        blocks.append(attention + mlp)
    kept = [
        4 * h if checkpointing == "full" or (checkpointing == "selective" and layer % 2 == 0) else size
        for layer, size in enumerate(blocks)
    ]
    return sum(kept) + max(blocks) + 16 * h + 64


def trainer_need(config: RlConfig) -> TrainerNeed:
    """The estimate described in the module docstring, for trainer rank 0."""
    trainer = config.trainer
    args = model_args(Path(trainer.model.name))
    counts = parameter_counts(args, trainer.model.lora)
    # LoRA: only the adapters train (fp32 with gradients and AdamW state, and travel); the base is frozen in the
    # compute dtype, so it needs no master copy, gradient or cast
    params = counts.adapters or counts.base
    frozen = counts.base * DTYPES[trainer.model.dtype].itemsize if counts.adapters else 0
    ranks = config.deploy.trainer_nproc
    tokens = config.orchestrator.micro_batch_rows * trainer.seq_len
    chunk = min(trainer.loss_chunk_size, tokens)
    vocab_by_hidden = args.vocab_size * args.hidden_size
    policy_bytes = DTYPES[config.inference.model.dtype].itemsize
    if trainer.speed.fused_loss:
        logits = FUSED_LOGIT_TEMPORARIES * chunk * args.vocab_size * DTYPES[trainer.model.dtype].itemsize
    else:
        logits = LOGIT_TEMPORARIES * chunk * args.vocab_size * 4
    shared = trainer.weights.transport == "shared" or (
        trainer.weights.transport == "auto" and config.inference.engine == "builtin"
    )
    allocated = {
        "states": -(-(STATE_BYTES * params + frozen) // ranks),
        "compute_copies": COMPUTE_COPY_BYTES * params,
        "handoff": (4 if counts.adapters else policy_bytes) * params if shared else 0,
        "activations": int(
            tokens * activation_bytes_per_token(args, trainer.activation_checkpointing, compiled=trainer.compile)
        ),
        # the logits chunks, and the LM head's fp32 gradient the fused loss accumulates (and its bf16 cast)
        "loss": logits + vocab_by_hidden * (4 + COMPUTE_COPY_BYTES),
        "optimizer_temporaries": -(-OPTIMIZER_TEMP_BYTES * params // ranks),
    }
    need = TrainerNeed(**allocated, slack=0)
    return TrainerNeed(**allocated, slack=CUDA_CONTEXT_BYTES + int(FRAGMENTATION * need.total))


def server_need(config: RlConfig) -> ServerNeed:
    inference = config.inference
    args = model_args(Path(inference.model.name))
    dtype = DTYPES[inference.model.dtype]
    counts = parameter_counts(args, inference.model.lora)
    folded_copy = counts.adapted * dtype.itemsize if inference.folds_lora else 0
    return ServerNeed(
        context=CUDA_CONTEXT_BYTES,
        weights=counts.base * dtype.itemsize + 4 * counts.adapters + folded_copy,
        activations=activation_bytes(inference, args, dtype),
        block=block_bytes(args, inference.block_size, dtype),
        state=state_bytes(args, state_slots(inference, args), dtype),
    )


def _gib_text(size: float) -> str:
    """Bytes as GiB to one decimal, for the sentences that explain a split."""
    return f"{size / GIB:.1f}"


def plan_shared_gpu(config: RlConfig, total_bytes: int, gpu_name: str = "") -> tuple[RlConfig, str]:
    """Split a GPU of `total_bytes` between the trainer and the servers: the config with the inference section's
    `gpu_memory_utilization` (and, built-in engine, `kv_cache_blocks`) set, and a sentence saying what was chosen.
    ConfigError when the trainer and the servers cannot both fit."""
    inference, servers = config.inference, config.deploy.inference_servers
    estimate = trainer_need(config)
    fixed_trainer = config.deploy.trainer_memory_gib != "auto"
    trainer = int(config.deploy.trainer_memory_gib * GIB) if fixed_trainer else estimate.total
    server = server_need(config)
    blocks_per_seq = -(-inference.seq_len // inference.block_size)
    least_blocks = blocks_per_seq + 2  # the scratch block and the scheduler's watermark
    most_blocks = inference.max_running * blocks_per_seq + 1
    set_fields = inference.model_fields_set
    user_blocks = inference.kv_cache_blocks if "kv_cache_blocks" in set_fields and inference.engine == "builtin" else 0
    user_share = inference.gpu_memory_utilization
    if "gpu_memory_utilization" not in set_fields or user_share == DEFAULT_UTILIZATION:
        user_share = None

    trainer_text = (
        f"trainer {_gib_text(trainer)} GiB (deploy.trainer_memory_gib; the estimate is {_gib_text(estimate.total)})"
        if fixed_trainer
        else _trainer_text(estimate)
    )
    per_server = (total_bytes - trainer) // servers
    if user_blocks:
        blocks, source = user_blocks, "inference.kv_cache_blocks"
    elif user_share is not None:
        blocks, source = (
            (int(user_share * total_bytes) - server.fixed) // server.block,
            "inference.gpu_memory_utilization",
        )
    else:
        blocks, source = min(most_blocks, (per_server - server.fixed) // server.block), ""
    share = server.fixed + blocks * server.block if user_share is None else int(user_share * total_bytes)
    if blocks < least_blocks or trainer + servers * share > total_bytes:
        raise ConfigError(
            _no_fit(config, total_bytes, gpu_name, trainer_text, trainer, server, least_blocks, blocks, source)
        )
    fraction = user_share if user_share is not None else _round_down(share / total_bytes)
    update: dict[str, object] = {"gpu_memory_utilization": fraction}
    if inference.engine == "builtin":
        update["kv_cache_blocks"] = blocks
    planned = config.model_copy(update={"inference": inference.model_copy(update=update)})
    free = total_bytes - trainer - servers * share
    each = f"{servers} inference servers, each" if servers > 1 else "inference"
    chosen = " (set)" if user_share is not None else ""
    kv_text = f"KV cache {_gib_text(blocks * server.block)} GiB = {blocks} blocks of {inference.block_size} tokens"
    if inference.engine == "vllm":
        kv_text = f"KV cache about {_gib_text(blocks * server.block)} GiB, sized by vLLM"
    message = (
        f"{_gpu_text(gpu_name, total_bytes)} shared: {trainer_text}; {each} gpu_memory_utilization "
        f"{fraction:g}{chosen} = {_gib_text(share)} GiB (weights {_gib_text(server.weights)}, step temporaries "
        f"{_gib_text(server.activations)}, CUDA context {_gib_text(server.context)}, {_state_text(server)}{kv_text}, room for "
        f"{min(blocks // blocks_per_seq, inference.max_running)} of max_running {inference.max_running} sequences of "
        f"seq_len {inference.seq_len}); {_gib_text(free)} GiB left free"
    )
    return planned, message


def _gpu_text(name: str, total: int) -> str:
    return f"GPU 0 ({name + ', ' if name else ''}{_gib_text(total)} GiB)"


def _state_text(server: ServerNeed) -> str:
    return f"recurrent state {_gib_text(server.state)}, " if server.state else ""


def _round_down(fraction: float) -> float:
    return int(fraction * 1000) / 1000


def _trainer_text(need: TrainerNeed) -> str:
    parts = [f"weights+grads+AdamW {_gib_text(need.states)}", f"bf16 copies {_gib_text(need.compute_copies)}"]
    if need.handoff:
        parts.append(f"hand-off buffer {_gib_text(need.handoff)}")
    parts += [
        f"activations {_gib_text(need.activations)}",
        f"loss {_gib_text(need.loss)}",
        f"slack {_gib_text(need.slack)}",
    ]
    return f"trainer ~{_gib_text(need.total)} GiB ({', '.join(parts)})"


def _no_fit(
    config: RlConfig,
    total: int,
    gpu_name: str,
    trainer_text: str,
    trainer: int,
    server: ServerNeed,
    least_blocks: int,
    blocks: int,
    source: str,
) -> str:
    servers = config.deploy.inference_servers
    least = server.fixed + least_blocks * server.block
    head = (
        f"{_gpu_text(gpu_name, total)} cannot hold both the trainer and inference: {trainer_text}; "
        f"{f'each of {servers} inference servers' if servers > 1 else 'inference'} needs at least {_gib_text(least)} GiB (weights {_gib_text(server.weights)}, step "
        f"temporaries {_gib_text(server.activations)}, CUDA context {_gib_text(server.context)}, {_state_text(server)}and a KV cache for one "
        f"seq_len {config.inference.seq_len} sequence, {least_blocks} blocks)"
    )
    if source:
        most = _round_down(max(0, total - trainer) / servers / total)
        head += (
            f"; {source} gives {max(blocks, 0)} KV blocks"
            f"{'' if blocks < least_blocks else ' but leaves the trainer too little'} (the most a server can take "
            f"here is gpu_memory_utilization {most:g}): change it, or leave it unset for the automatic split"
        )
    return (
        f"{head}. Put them on separate GPUs (deploy.trainer_gpus, deploy.inference_gpus), or make the trainer "
        'smaller (orchestrator.micro_batch_rows, seq_len, trainer.activation_checkpointing = "full"; '
        "deploy.trainer_memory_gib if the estimate is too high), or inference's (inference.max_running, "
        "inference.max_prefill_tokens)"
    )
