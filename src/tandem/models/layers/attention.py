"""One attention module, three ways to attend: causal SDPA, document-masked (packed) SDPA or flex, and KV cache.

What differs between the paths is described by `AttnInputs`, built once per forward outside the decoder blocks,
so a block's forward has no data-dependent Python branching (the branch is on which fields are set).

Documents: wherever `position_ids` does not continue `previous + 1` a new document starts; a token attends
only to earlier tokens of its own document. Padding tokens (attention_mask == 0) are one-token documents, so no
query row is ever fully masked (SDPA would return NaN for it) and real tokens never see them. The same document
starts (`AttnInputs.resets`) reset the recurrent state of linear-attention layers (`layers.gated_deltanet`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import Fused, HFLayout, WeightMap, param_kinds, same_names
from ..runtime import ModelRuntime
from .kv_cache import CacheBatch, KVCache
from .norm import RMSNorm
from .rope import ROPE_BACKENDS, check_rope_backend, rotate_leading
from .state_cache import StateBatch, StateCache


@dataclass(frozen=True)
class AttnInputs:
    """How every layer of one forward attends. Exactly one of: nothing (causal), `mask`, `block_mask`, `cache`.

    `resets` comes with `mask` / `block_mask` (where documents start, for linear-attention layers); `state` and
    `state_batch` come with `cache` in hybrid models (the linear layers' recurrent state, `layers.state_cache`).
    """

    mask: torch.Tensor | None = None  # bool [B, 1, S, S], True where a query may attend a key
    block_mask: Any = None  # flex_attention BlockMask
    cache: KVCache | None = None
    cache_batch: CacheBatch | None = None
    resets: torch.Tensor | None = None  # bool [B, S], True where a document (or a padding token) starts
    state: StateCache | None = None
    state_batch: StateBatch | None = None


def document_starts(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, S]` bool: True where a document starts (positions restart; each padding token, the token after one)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        pad = attention_mask == 0
        starts = starts | pad
        starts[:, 1:] |= pad[:, :-1]
    return starts


def document_ids(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Document index `[B, S]` per token: new where positions restart; padding tokens get a document each."""
    return document_starts(position_ids, attention_mask).long().cumsum(dim=1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal boolean mask `[B, 1, S, S]` from document ids."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def _flex_block_mask(documents: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (documents[b, q] == documents[b, kv])

    batch, seq = documents.shape
    return create_block_mask(mask_mod, batch, None, seq, seq, device=documents.device)


FLEX_MIN_HEAD_DIM = 16
"""flex_attention's kernels need query, key and value heads of at least this many dims."""


def attention_inputs(
    backend: str,
    device: torch.device,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    head_dims: tuple[int, int] = (FLEX_MIN_HEAD_DIM, FLEX_MIN_HEAD_DIM),
) -> AttnInputs:
    """Pick the path for a training/scoring forward.

    No positions and no padding: plain causal SDPA. Otherwise documents: `flex` (GPU; no CPU backward; heads of
    at least `FLEX_MIN_HEAD_DIM`), `sdpa` with an explicit mask (works everywhere), or `auto` = flex on CUDA where
    the model's `head_dims` (query/key, value) allow it, SDPA elsewhere.
    """
    if position_ids is None and attention_mask is None:
        return AttnInputs()
    if position_ids is None:
        position_ids = torch.arange(attention_mask.shape[1], device=device).expand(attention_mask.shape[0], -1)
    starts = document_starts(position_ids, attention_mask)
    documents = starts.long().cumsum(dim=1)
    flex_fits = min(head_dims) >= FLEX_MIN_HEAD_DIM
    if backend == "auto":
        backend = "flex" if device.type == "cuda" and flex_fits else "sdpa"
    if backend == "flex":
        if not flex_fits:
            raise ValueError(f"attn_backend flex needs heads of at least {FLEX_MIN_HEAD_DIM} dims, got {head_dims}")
        return AttnInputs(block_mask=_flex_block_mask(documents), resets=starts)
    return AttnInputs(mask=document_mask(documents), resets=starts)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA over `[B, H, S, D]` with GQA; causal when `mask` is None.

    With an explicit mask on CUDA the fused kernels do not take GQA, so K/V heads are repeated there instead.
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if q.is_cuda and k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttnInputs, scale: float) -> torch.Tensor:
    """Uncached attention over `[B, S, H, D]` q, k, v (v's head dim may differ) -> `[B, S, Hq, Dv]`."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn.block_mask is not None:
        return _flex(q, k, v, attn.block_mask, scale).transpose(1, 2)
    return sdpa(q, k, v, attn.mask, scale).transpose(1, 2)


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, batch: CacheBatch, layer: int, scale: float
) -> torch.Tensor:
    """Packed new tokens `[T, H, D]`: write their K/V, then attend per sequence to everything cached so far."""
    cache.write(layer, batch, k, v)
    keys, values = cache.read(layer, batch)
    return attend_cached(q, keys, values, batch, scale)


def attend_cached(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: CacheBatch, scale: float
) -> torch.Tensor:
    """Packed queries `[T, Hq, D]` against each sequence's cached keys / values `[N, max_kv, Hkv, D | Dv]`.

    With one new token per sequence (decode), the query heads sharing a KV head become that head's query
    rows, so attention runs over `Hkv` heads without repeating K/V (the fused kernels take no GQA with a mask).
    """
    if batch.unpack_index.shape[1] == 1:
        rows, kv_heads = keys.shape[0], keys.shape[2]
        queries = q.unflatten(1, (kv_heads, -1))  # [N, Hkv, Hq / Hkv, D]
        out = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask, scale=scale
        )
        return out.reshape(rows, -1, values.shape[-1])
    queries = q[batch.unpack_index]  # [N, max_new, Hq, D]
    out = sdpa(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), batch.mask, scale)
    return out.transpose(1, 2).flatten(0, 1)[batch.pack_index]


class Attention(nn.Module):
    """GQA attention with fused QKV (`qkv_proj` rows: q heads, then k heads, then v heads) and optional qk-norm.

    RoPE rotates the leading `cos.shape[-1]` dims of each head (all of them unless partial rotary, GLM-4.5,
    Qwen3-Next). With `args.attn_output_gate` (Qwen3-Next) the q rows hold, per head, the query then a gate of the
    same size (HF's `q_proj` layout); the attention output is multiplied by `sigmoid(gate)` before `o_proj`.
    """

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        check_rope_backend(runtime.rope_backend)
        self.layer_idx, self.head_dim, self.rope_backend = layer_idx, args.head_dim, runtime.rope_backend
        self.gated, self.rope_free = args.attn_output_gate, args.rope_free
        self.sizes = (
            args.num_heads * args.head_dim * (2 if self.gated else 1),
            args.num_kv_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.scale = args.head_dim**-0.5
        self.qkv_proj = nn.Linear(args.hidden_size, sum(self.sizes), bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.attention_out_bias)
        centered = args.zero_centered_norm
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, centered) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, centered) if args.qk_norm else None

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """`q_proj`, `k_proj`, `v_proj` fused into `qkv_proj` (+ bias; gated: `q_proj` holds the gate rows too),
        `o_proj` (+ bias) and the qk-norms under HF's names."""
        kv_size = args.num_kv_heads * args.head_dim
        q_size = args.num_heads * args.head_dim * (2 if args.attn_output_gate else 1)
        out = {
            f"qkv_proj.{kind}": Fused((tuple(f"{p}_proj.{kind}" for p in "qkv"),), (q_size, kv_size, kv_size))
            for kind in param_kinds(args.attention_bias)
        }
        out |= same_names(*(f"o_proj.{kind}" for kind in param_kinds(args.attention_out_bias)))
        return out | same_names(*(f"{n}.weight" for n in (("q_norm", "k_norm") if args.qk_norm else ())))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs) -> torch.Tensor:
        """`x` `[B, S, hidden]`, cos/sin `[B, S, rotary_dim]` -> `[B, S, hidden]` (cache path: B == 1, packed)."""
        batch, seq, _ = x.shape
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in self.qkv_proj(x).split(self.sizes, dim=-1))
        gate = None
        if self.gated:
            q, gate = q.unflatten(-2, (-1, 2)).unbind(-2)  # per head: query rows, then gate rows
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rope_free:  # Nemotron-H's attention has no position embedding
            q, k = rotate_leading(ROPE_BACKENDS[self.rope_backend], q, k, cos, sin)
        if attn.cache is not None and attn.cache_batch is not None:
            out = cached_attention(q[0], k[0], v[0], attn.cache, attn.cache_batch, self.layer_idx, self.scale)
        else:
            out = attend(q, k, v, attn, self.scale)
        out = out.reshape(batch, seq, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)
