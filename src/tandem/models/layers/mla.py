"""Multi-head latent attention (DeepSeek-V2/V3; HF `DeepseekV3Attention`) on every path `Attention` serves.

Per token, `kv_a_proj_with_mqa` gives a rank-`kv_lora_rank` latent `c` (normed by `kv_a_layernorm`) and one
`qk_rope_head_dim` RoPE key shared by all heads; `kv_b_proj` expands `c` into each head's non-rotary key
(`qk_nope_head_dim`) and value (`v_head_dim`). Queries come from `q_proj`, or through the low-rank
`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; each head's query is its non-rotary part, then its RoPE part.

Training and scoring expand `c` and attend like any multi-head attention. The KV cache stores only `c` and the
rotated RoPE key (`kv_lora_rank + qk_rope_head_dim` values per token and layer, instead of
`H * (qk_head_dim + v_head_dim)`) and attends in latent space with `kv_b_proj` absorbed: a head's score
`q_nope . (W_k c)` is `(W_k^T q_nope) . c`, and its output `sum_j p_j W_v c_j` is `W_v sum_j p_j c_j`. The cached
step is therefore single-head attention whose keys are the cached rows and whose values are their latent part.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelArgs
from ..hf_layout import HFLayout, WeightMap, same_names
from ..runtime import ModelRuntime
from .attention import AttnInputs, attend, attend_cached
from .kv_cache import CacheBatch, KVCache
from .norm import RMSNorm
from .rope import ROPE_BACKENDS, check_rope_backend, deinterleave, softmax_scale

LATENT_NORM_EPS = 1e-6  # HF builds `q_a_layernorm` and `kv_a_layernorm` with the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    """MLA with HF's parameter names; `cos`/`sin` cover the `qk_rope_head_dim` RoPE part only."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        if args.mla is None:
            raise ValueError("MLAttention needs ModelArgs.mla")
        check_rope_backend(runtime.rope_backend)
        mla = self.mla = args.mla
        self.layer_idx, self.num_heads, self.rope_backend = layer_idx, args.num_heads, runtime.rope_backend
        self.scale = softmax_scale(args.rope, mla.qk_head_dim)
        hidden, q_size = args.hidden_size, args.num_heads * mla.qk_head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=False) if mla.q_lora_rank is None else None
        self.q_a_proj, self.q_a_layernorm, self.q_b_proj = None, None, None
        if mla.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        latent_size = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(hidden, latent_size, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, args.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(args.num_heads * mla.v_head_dim, hidden, bias=args.attention_out_bias)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """The projections and latent norms, unfused, under HF's names."""
        assert args.mla is not None
        low_rank_q = args.mla.q_lora_rank is not None
        names = [
            *(("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") if low_rank_q else ("q_proj.weight",)),
            "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight",
            "kv_b_proj.weight",
            "o_proj.weight",
        ]
        if args.attention_bias:
            names += [*(("q_a_proj.bias",) if low_rank_q else ()), "kv_a_proj_with_mqa.bias"]
        if args.attention_out_bias:
            names.append("o_proj.bias")
        return same_names(*names)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """All heads' queries `[..., H * qk_head_dim]`, directly or through the normed low-rank bottleneck."""
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs) -> torch.Tensor:
        """`x` `[B, S, hidden]`, cos/sin `[B, S, qk_rope_head_dim]` -> `[B, S, hidden]` (cache path: B == 1)."""
        mla, heads = self.mla, self.num_heads
        batch, seq, _ = x.shape
        q = self._queries(x).unflatten(-1, (heads, mla.qk_head_dim))
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent), k_rope[:, :, None]  # the RoPE key: one head, shared
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = ROPE_BACKENDS[self.rope_backend](q_rope, k_rope, cos, sin)
        if attn.cache is not None and attn.cache_batch is not None:
            out = self._cached(q_nope[0], q_rope[0], latent[0], k_rope[0], attn.cache, attn.cache_batch)
        else:
            kv = self.kv_b_proj(latent).unflatten(-1, (heads, -1))
            k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
            out = attend(torch.cat((q_nope, q_rope), dim=-1), k, v, attn, self.scale)
        return self.o_proj(out.reshape(batch, seq, -1))

    def _cached(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
    ) -> torch.Tensor:
        """Packed new tokens (`q_*` `[T, H, *]`, `latent` `[T, R]`, `k_rope` `[T, 1, Dr]`): cache `[latent, k_rope]`,
        attend in latent space (module docstring), return each head's output `[T, H, v_head_dim]`."""
        rank = self.mla.kv_lora_rank
        cache.write_keys(self.layer_idx, batch, torch.cat((latent[:, None], k_rope), dim=-1))
        rows = cache.read_keys(self.layer_idx, batch)  # [N, max_kv, 1, R + Dr]
        w_k, w_v = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1)).split(
            [self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=1
        )  # [H, Dn, R], [H, Dv, R]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_k)
        out = attend_cached(torch.cat((q_latent, q_rope), dim=-1), rows, rows[..., :rank], batch, self.scale)
        return torch.einsum("thr,hvr->thv", out, w_v)
