"""How many KV-cache blocks the engine gets: the configured count, or what fits in memory."""

from __future__ import annotations

import logging

import torch

from tandem.config.inference import InferenceConfig
from tandem.models import ModelArgs, StateCache

logger = logging.getLogger(__name__)

CPU_BUDGET_BYTES = 2**30
ACTIVATION_RESERVE_BYTES = 2**30
"""Kept free on the GPU beyond the estimate below, for the allocator's fragmentation and CUDA graphs."""


def block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: what every attention layer caches per token (K and V, or MLA's latent) times the block
    size; a hybrid's recurrent layers cache none (`ModelArgs.kv_layers`)."""
    heads, key_dim, value_dim = args.kv_cache_shape
    return len(args.kv_layers) * block_size * heads * (key_dim + value_dim) * dtype.itemsize


def state_bytes(args: ModelArgs, num_slots: int, dtype: torch.dtype) -> int:
    """Bytes of a hybrid model's recurrent-state cache of `num_slots` slots (`StateCache.for_model`, sized on the
    meta device, whatever the layers' kind); 0 for a model without recurrent layers."""
    if not args.is_hybrid:
        return 0
    state = StateCache.for_model(args, num_slots, dtype, device="meta")
    return sum(t.numel() * t.element_size() for store in (state.conv, state.recurrent) for t in store.values())


def state_slots(config: InferenceConfig, args: ModelArgs) -> int:
    """Recurrent-state slots the engine keeps: one per running sequence and a scratch one (0 without linear
    layers)."""
    return config.max_running + 1 if args.is_hybrid else 0


def activation_bytes(config: InferenceConfig, args: ModelArgs, dtype: torch.dtype) -> int:
    """A generous estimate of one step's peak temporaries: the sampler's `[rows, vocab]` buffers (fp32 logits,
    sort values, int64 indices and hash noise), a prefill chunk's MLP activations, and with DeepSeek-V3.2's indexer
    its fp32 scores of the chunk's queries against a whole context, per indexer head and after the ReLU."""
    sampler = 16 * config.max_running * args.vocab_size * 4
    prefill = 16 * config.max_prefill_tokens * max(args.hidden_size, args.intermediate_size) * dtype.itemsize
    if args.indexer is not None:
        prefill += 2 * config.max_prefill_tokens * args.indexer.num_heads * config.seq_len * 4
    return sampler + prefill + ACTIVATION_RESERVE_BYTES


def kv_cache_blocks(config: InferenceConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> int:
    """`config.kv_cache_blocks`, else on CUDA what `gpu_memory_utilization` leaves after the weights (already
    loaded) and activations, else on CPU room for `max_running` full-length sequences within 1 GiB. A hybrid
    model's recurrent-state cache (`state_bytes`, allocated beside the KV cache) comes out of the budget first."""
    if config.kv_cache_blocks:
        return config.kv_cache_blocks
    per_block = block_bytes(args, config.block_size, dtype)
    slots = state_slots(config, args)
    state = state_bytes(args, slots, dtype)
    if state:
        logger.info("recurrent state: %d slots (%.2f GiB) before the KV cache", slots, state / 2**30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes(config, args, dtype)
        blocks = (budget - state) // per_block
        if blocks < 2:
            recurrent = f", {state / 2**30:.2f} GiB of it for the recurrent state of max_running" if state else ""
            raise ValueError(
                f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB at "
                f"gpu_memory_utilization={config.gpu_memory_utilization}{recurrent}); raise it or set kv_cache_blocks"
            )
        return blocks
    wanted = config.max_running * -(-config.seq_len // config.block_size) + 1
    return max(2, min(wanted, max(0, CPU_BUDGET_BYTES - state) // per_block))
