"""The decode step on Triton kernels (`tandem.kernels.decode`): the same weights and cache, far fewer kernels.

`decode.decode_step` runs the model module by module (~61 kernels a layer); this runs the same computation
as ~12 kernels a layer, over the model's own parameters, and reads K/V in place through the block table. It
takes the same `[N, 2 + W]` inputs, so it is captured into the same per-bucket CUDA graphs. Dense layers
use the fused SiLU kernel; MoE layers call their module (router and experts), unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.models import CausalLM, KVCache
from tandem.models.layers.mlp import GatedMLP

# cuBLAS picks a far slower kernel for a one-row product on some shapes (Qwen3-0.6B's o_proj, 1024 x 2048:
# 12.3 us for one row, 5.0 us for eight, on the H200), so the attention output feeding it has at least 8 rows.
O_PROJ_MIN_ROWS = 8


def fused_decode_supported(model: CausalLM) -> str | None:
    """Why the fused step cannot run `model`, or None when it can."""
    dim = model.args.head_dim
    if dim & (dim - 1):
        return f"head_dim {dim} is not a power of two"
    return None


def fused_decode_step(model: CausalLM, cache: KVCache, inputs: torch.Tensor) -> torch.Tensor:
    """Logits `[N, V]` for `inputs` `[N, 2 + W]` = (token, cached length, block table...) per row."""
    from tandem.kernels.decode import add_rms_norm, paged_decode_attention, qk_norm_rope_store
    from tandem.kernels.swiglu import silu_mul

    tokens, lengths, tables = inputs[:, 0], inputs[:, 1].contiguous(), inputs[:, 2:]
    size = cache.block_size
    write_index = tables.gather(1, (lengths // size)[:, None])[:, 0] * size + lengths % size
    residual = model.embed_tokens(tokens)
    cos, sin = model.rotary(lengths, residual.dtype)
    eps = model.args.rms_norm_eps
    delta = None
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        x = add_rms_norm(delta, residual, layer.input_layernorm.weight, eps)
        qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
        q_norm = None if attn.q_norm is None else attn.q_norm.weight
        k_norm = None if attn.k_norm is None else attn.k_norm.weight
        q = qk_norm_rope_store(qkv, q_norm, k_norm, eps, cos, sin, cache.k[index], cache.v[index], write_index)
        out = paged_decode_attention(
            q, cache.k[index], cache.v[index], tables, lengths, attn.scale, min_rows=O_PROJ_MIN_ROWS
        )
        delta = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)[: tokens.shape[0]]
        x = add_rms_norm(delta, residual, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            hidden = silu_mul(F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias))
            delta = F.linear(hidden, mlp.down_proj.weight, mlp.down_proj.bias)
        else:
            delta = mlp(x)
    return model.compute_logits(add_rms_norm(delta, residual, model.norm.weight, eps))
