"""The decode step on Triton kernels (`tandem.kernels.decode`): the same weights and cache, far fewer kernels.

`decode.decode_step` runs the model module by module (~61 kernels a layer); this runs the same computation
as ~10 kernels a layer, over the model's own parameters, and reads K/V in place through the block table. It
takes the same `[N, 2 + W]` inputs, so it is captured into the same per-bucket CUDA graphs. Dense layers
use the fused SiLU kernel; MoE layers call their module (router and experts), unchanged.

A step of one row (batch 1 of a dense model) runs its projections on tandem's GEMV (`kernels.gemv`), which
takes the RMSNorm before a projection and the SwiGLU after it into the same kernel: 7 kernels a layer, each
launched, on Hopper, as a programmatic dependent of the one before (its weights load while that one ends).
A step of several rows runs qk-norm + RoPE + cache write, attention and the split combine as one kernel
(`kernels.decode.decode_attention`); a step on the one-row GEMVs keeps them as three, which its programmatic
dependent launches overlap: at one row the single kernel measured slower, at several rows faster
(`benchmarks/decode_profile.py --steps triton triton-attn1 triton-attn3`; benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.models import CausalLM, DecoderBlock, KVCache
from tandem.models.layers.mlp import GatedMLP
from tandem.models.lora import lora_args, lora_folded

# cuBLAS picks a far slower kernel for a one-row product on some shapes (Qwen3-0.6B's o_proj, 1024 x 2048, than
# for eight rows; benchmarks/RESULTS.md), so the attention output feeding it has at least 8 rows.
O_PROJ_MIN_ROWS = 8


def fused_decode_supported(model: CausalLM) -> str | None:
    """Why the fused step cannot run `model`, or None when it can."""
    args = model.args
    if args.is_hybrid:
        return "recurrent-state layers (a hybrid model: linear attention, Mamba): the kernels cover attention only"
    if model.visual is not None:
        return "a vision-language model: its M-RoPE offsets run in the module step"
    if lora_args(model) is not None and not lora_folded(model):
        return "unfolded LoRA adapters (inference.lora_fold = false): the kernels read only each projection's `.weight`"
    if args.mla is not None:
        return "multi-head latent attention has its own cached path (no qkv_proj, no V cache)"
    if args.rotary_dim != args.head_dim:
        return f"partial rotary ({args.rotary_dim} of {args.head_dim} head dims)"
    dim = args.head_dim
    if dim & (dim - 1):
        return f"head_dim {dim} is not a power of two"
    return None


@dataclass
class _Step:
    """What every layer of one decode step reads besides its own weights and cache."""

    cos: torch.Tensor
    sin: torch.Tensor
    write_index: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    cache: KVCache
    eps: float
    pdl: bool
    arrivals: torch.Tensor | None
    """`decode_attention`'s split counters, shared by every layer (each launch leaves them zeroed); None: the
    three-kernel attention."""


def fused_decode_step(
    model: CausalLM,
    cache: KVCache,
    inputs: torch.Tensor,
    one_row_gemv: bool = True,
    fused_attention: bool | None = None,
) -> torch.Tensor:
    """Logits `[N, V]` for `inputs` `[N, 2 + W]` = (token, cached length, block table...) per row.

    `one_row_gemv`: a one-row step of a dense model runs on the fused GEMVs (`kernels.gemv`), not cuBLAS.
    `fused_attention`: qk-norm + RoPE + cache write, attention and the split combine as one kernel
    (`kernels.decode.decode_attention`) instead of three; None: the faster of the two as measured, one kernel
    unless the step runs on the one-row GEMVs."""
    from tandem.kernels.decode import add_rms_norm, arrival_counters
    from tandem.kernels.gemv import norm_gemv, pdl_supported

    tokens, lengths, tables = inputs[:, 0], inputs[:, 1].contiguous(), inputs[:, 2:]
    size = cache.block_size
    write_index = tables.gather(1, (lengths // size)[:, None])[:, 0] * size + lengths % size
    residual = model.embed_tokens(tokens)
    cos, sin = model.rotary(lengths, residual.dtype)
    dense = all(isinstance(layer.mlp, GatedMLP) for layer in model.layers)
    one_row = one_row_gemv and dense and tokens.shape[0] == 1
    pdl = one_row and pdl_supported(residual.device)
    if fused_attention is None:
        fused_attention = not one_row
    arrivals = arrival_counters(tokens.shape[0], model.args.num_kv_heads, tokens.device) if fused_attention else None
    step = _Step(cos, sin, write_index, tables, lengths, cache, model.args.rms_norm_eps, pdl, arrivals)
    layer_step = _one_row_layer if one_row else _layer
    delta = None
    for index, layer in enumerate(model.layers):
        residual, delta = layer_step(layer, index, residual, delta, step)
    if one_row:  # the final norm and the LM head in one GEMV too
        return norm_gemv(residual, delta, model.norm.weight, step.eps, model.lm_head_weight, pdl=pdl)[0]
    return model.compute_logits(add_rms_norm(delta, residual, model.norm.weight, step.eps))


def _attention(layer: DecoderBlock, index: int, qkv: torch.Tensor, step: _Step, rows: int) -> torch.Tensor:
    """qk-norm + RoPE + layer `index`'s cache write, then paged attention: `[max(N, rows), Hq * D]`."""
    from tandem.kernels.decode import decode_attention, paged_decode_attention, qk_norm_rope_store

    attn = layer.self_attn
    k_cache, v_cache = step.cache.k[index], step.cache.v[index]
    q_norm = None if attn.q_norm is None else attn.q_norm.weight
    k_norm = None if attn.k_norm is None else attn.k_norm.weight
    cos, sin, pdl, eps, tables, lengths = step.cos, step.sin, step.pdl, step.eps, step.tables, step.lengths
    if step.arrivals is not None:
        return decode_attention(
            qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, step.write_index, tables, lengths, attn.scale,
            min_rows=rows, pdl=pdl, arrivals=step.arrivals,
        )  # fmt: skip
    q = qk_norm_rope_store(qkv, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, step.write_index, pdl=pdl)
    return paged_decode_attention(q, k_cache, v_cache, tables, lengths, attn.scale, min_rows=rows, pdl=pdl)


def _layer(
    layer: DecoderBlock, index: int, residual: torch.Tensor, delta: torch.Tensor | None, step: _Step
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of N rows on cuBLAS's GEMMs: `residual += delta` in place; returns (residual, the layer's delta)."""
    from tandem.kernels.decode import add_rms_norm
    from tandem.kernels.swiglu import silu_mul

    attn, mlp = layer.self_attn, layer.mlp
    x = add_rms_norm(delta, residual, layer.input_layernorm.weight, step.eps)
    qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
    out = _attention(layer, index, qkv, step, O_PROJ_MIN_ROWS)
    delta = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)[: residual.shape[0]]
    x = add_rms_norm(delta, residual, layer.post_attention_layernorm.weight, step.eps)
    if isinstance(mlp, GatedMLP):
        hidden = silu_mul(F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias))
        return residual, F.linear(hidden, mlp.down_proj.weight, mlp.down_proj.bias)
    return residual, mlp(x)


def _one_row_layer(
    layer: DecoderBlock, index: int, residual: torch.Tensor, delta: torch.Tensor | None, step: _Step
) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense layer of one row in 7 kernels: the norms fused into the GEMVs after them, SwiGLU into gate/up's."""
    from tandem.kernels.gemv import gemv, norm_gemv

    attn, mlp, eps, pdl = layer.self_attn, layer.mlp, step.eps, step.pdl
    qkv_proj, up_proj = attn.qkv_proj, mlp.gate_up_proj
    qkv, residual = norm_gemv(
        residual, delta, layer.input_layernorm.weight, eps, qkv_proj.weight, qkv_proj.bias, pdl=pdl
    )
    out = _attention(layer, index, qkv, step, rows=1)
    delta = gemv(out, attn.o_proj.weight, attn.o_proj.bias, pdl=pdl)
    norm = layer.post_attention_layernorm.weight
    hidden, residual = norm_gemv(residual, delta, norm, eps, up_proj.weight, up_proj.bias, swiglu=True, pdl=pdl)
    return residual, gemv(hidden, mlp.down_proj.weight, mlp.down_proj.bias, pdl=pdl)
