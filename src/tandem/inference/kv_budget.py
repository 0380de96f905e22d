"""How many KV-cache blocks the engine gets: the configured count, or what fits in memory."""

from __future__ import annotations

import torch

from tandem.config.inference import InferenceConfig
from tandem.models import ModelArgs

CPU_BUDGET_BYTES = 2**30
ACTIVATION_RESERVE_BYTES = 2**30
"""Kept free on the GPU beyond the estimate below, for the allocator's fragmentation and CUDA graphs."""


def block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: what every layer caches per token (K and V, or MLA's latent) times the block size."""
    heads, key_dim, value_dim = args.kv_cache_shape
    return args.num_layers * block_size * heads * (key_dim + value_dim) * dtype.itemsize


def activation_bytes(config: InferenceConfig, args: ModelArgs, dtype: torch.dtype) -> int:
    """A generous estimate of one step's peak temporaries: the sampler's `[rows, vocab]` buffers (fp32 logits,
    sort values, int64 indices and hash noise) and a prefill chunk's MLP activations."""
    sampler = 16 * config.max_running * args.vocab_size * 4
    prefill = 16 * config.max_prefill_tokens * max(args.hidden_size, args.intermediate_size) * dtype.itemsize
    return sampler + prefill + ACTIVATION_RESERVE_BYTES


def kv_cache_blocks(config: InferenceConfig, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> int:
    """`config.kv_cache_blocks`, else on CUDA what `gpu_memory_utilization` leaves after the weights (already
    loaded) and activations, else on CPU room for `max_running` full-length sequences within 1 GiB."""
    if config.kv_cache_blocks:
        return config.kv_cache_blocks
    per_block = block_bytes(args, config.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes(config, args, dtype)
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(
                f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB at "
                f"gpu_memory_utilization={config.gpu_memory_utilization}); raise it or set kv_cache_blocks"
            )
        return blocks
    wanted = config.max_running * -(-config.seq_len // config.block_size) + 1
    return max(2, min(wanted, CPU_BUDGET_BYTES // per_block))
