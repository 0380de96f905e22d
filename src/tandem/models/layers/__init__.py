"""Building blocks shared by every architecture: attention (+ KV cache), RoPE, norms, dense MLP, MoE."""

from .attention import Attention, AttnInputs, attention_inputs, document_ids, document_mask
from .kv_cache import CacheBatch, KVCache
from .mlp import GatedMLP
from .moe import MOE_BACKENDS, MoE, route
from .norm import RMSNorm
from .rope import ROPE_BACKENDS, RotaryEmbedding, apply_rope, inv_frequencies, rope_cos_sin
from .state_cache import StateBatch, StateCache

__all__ = [
    "MOE_BACKENDS",
    "ROPE_BACKENDS",
    "Attention",
    "AttnInputs",
    "CacheBatch",
    "GatedMLP",
    "KVCache",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "StateBatch",
    "StateCache",
    "apply_rope",
    "attention_inputs",
    "document_ids",
    "document_mask",
    "inv_frequencies",
    "rope_cos_sin",
    "route",
]
