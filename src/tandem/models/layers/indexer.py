"""DeepSeek Sparse Attention (DeepSeek-V3.2; HF `DeepseekV32Indexer` + `DeepseekV32Attention`): MLA restricted,
per query, to the `topk` keys a lightweight "lightning indexer" scores highest.

The indexer (`Indexer`, under `self_attn.indexer` with HF's parameter names) has `num_heads` query heads of
`head_dim`, projected by `wq_b` from MLA's normed query latent `q_a_layernorm(q_a_proj(x))`, and one key per
token, `k_norm(wk(x))` (a LayerNorm with bias). The leading `qk_rope_head_dim` dims of each carry RoPE, in the
half-split layout (not MLA's interleaved one), with MLA's cos/sin. Query token s scores key t as

    I[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * head_dim ** -0.5),    w = weights_proj(x) * num_heads ** -0.5

in fp32 (`weights_proj` in fp32, as transformers keeps it), over the keys s may attend (causal, inside its
document); the `topk` best of those are kept (all of them when there are fewer). MLA then attends under the
mask `allowed & selected` — the mask-based reference: O(S^2) scores and mask per layer, like transformers'
eager path. The indexer runs without gradient (as in transformers: the top-k choice is discrete; DeepSeek trains
the indexer with its own KL loss, which is not implemented here).

`INDEX_BACKENDS` computes the masked scores: `index_scores` here (the reference, op for op as transformers), or
a Triton kernel registered by its user (`tandem.kernels.indexer.index_scores_triton`; this package imports
nothing else of tandem).

Cached path: the indexer key of every token is cached in the same key-only row as MLA's latent and RoPE key
(`ModelArgs.kv_cache_shape`: `kv_lora_rank + qk_rope_head_dim + index head_dim` per token and layer), so the
engine's cache allocation is unchanged. A cached step scores its new queries against each sequence's cached
indexer keys under `CacheBatch.mask`, takes the top-k, and attends in latent space (`layers.mla`) under the
narrowed mask: the same selection as the full forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import HFLayout, WeightMap, nest, same_names
from ..runtime import ModelRuntime
from .attention import AttnInputs, attend_cached, sdpa
from .kv_cache import CacheBatch, KVCache
from .mla import MLAttention
from .rope import ROPE_BACKENDS, deinterleave

INDEX_NORM_EPS = 1e-6  # HF builds the indexer's `k_norm` LayerNorm with eps 1e-6

IndexScoresFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]


def index_scores(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Indexer scores `[B, S, T]` (fp32) of queries `q` `[B, S, H, D]` against keys `k` `[B, T, D]`, per-head
    weights `[B, S, H]` (fp32, `num_heads ** -0.5` included); `-inf` where `allowed` `[B, S, T]` is False (None:
    causal, the S queries being the last S of the T keys). Op for op as transformers computes them."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale  # [B, S, H, T]
    scores = torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)
    if allowed is None:
        seq, keys = scores.shape[-2:]
        allowed = torch.ones(seq, keys, dtype=torch.bool, device=scores.device).tril(keys - seq)
    return scores.masked_fill(~allowed, float("-inf"))


INDEX_BACKENDS: dict[str, IndexScoresFn] = {"torch": index_scores}


def check_index_backend(name: str) -> None:
    if name not in INDEX_BACKENDS:
        raise ValueError(f"unknown index_backend {name!r}; known: {sorted(INDEX_BACKENDS)} (register Triton's first)")


def topk_selected(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Bool `[B, S, T]`: each query's `topk` best-scored keys among those not `-inf` (all of them if fewer).

    Exact ties at the cut go to the earliest keys. ReLU makes ties common (a key that every head scores
    negatively scores exactly 0), and `torch.topk` breaks them differently for different lengths, so without a
    rule a cached step (or a packed document) could choose other keys than the full forward. transformers takes
    `torch.topk`'s choice: where a tie straddles the cut, its selection may differ from this one."""
    count = min(topk, scores.shape[-1])
    cut = scores.topk(count, dim=-1).values[..., -1:]
    above, tied = scores > cut, scores == cut
    missing = count - above.sum(-1, keepdim=True, dtype=torch.int32)
    selected = above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= missing))
    return selected & (scores != float("-inf"))


class Indexer(nn.Module):
    """The lightning indexer's projections (HF names: `wq_b`, `wk`, `k_norm`, `weights_proj`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.indexer is None or args.mla is None or args.mla.q_lora_rank is None:
            raise ValueError("Indexer needs ModelArgs.indexer and MLA with a low-rank query (q_lora_rank)")
        index = args.indexer
        self.num_heads, self.head_dim, self.topk = index.num_heads, index.head_dim, index.topk
        self.rope_dim, self.scale = args.mla.qk_rope_head_dim, index.head_dim**-0.5
        self.wq_b = nn.Linear(args.mla.q_lora_rank, index.num_heads * index.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, index.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(index.head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, index.num_heads, bias=False)

    @staticmethod
    def hf_weights() -> WeightMap:
        return same_names("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")

    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_backend: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `[B, S, H, D]`, keys `[B, S, D]` (RoPE applied) and fp32 head weights `[B, S, H]`."""
        q = self.wq_b(q_latent).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_norm(self.wk(x))[:, :, None]
        q_rot, q_pass = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_rot, k_pass = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_rot, k_rot = ROPE_BACKENDS[rope_backend](q_rot, k_rot, cos, sin)
        q, k = torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)[:, :, 0]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
        return q, k, weights


def _allowed(attn: AttnInputs, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Which keys each query may attend `[B, S, S]`: the document mask, the flex block mask's, or causal."""
    if attn.mask is not None:
        return attn.mask[:, 0]
    if attn.block_mask is not None:
        from torch.nn.attention.flex_attention import create_mask

        return create_mask(attn.block_mask.mask_mod, batch, None, seq, seq, device=device)[:, 0]
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, seq, seq)


class SparseMLAttention(MLAttention):
    """MLA whose every query attends only to the keys its `indexer` selects (module docstring)."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__(args, layer_idx, runtime)
        check_index_backend(runtime.index_backend)
        self.index_backend = runtime.index_backend
        self.indexer = Indexer(args)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """MLA's tensors and the indexer's (`indexer.*`), under HF's names."""
        return MLAttention.hf_weights(args, layout) | nest("indexer.", Indexer.hf_weights())

    def _select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """`allowed` `[B, S, T]` narrowed to each query's top-k keys by indexer score."""
        with torch.no_grad():
            scores = INDEX_BACKENDS[self.index_backend](q, k, weights, self.indexer.scale, allowed)
            return topk_selected(scores, self.indexer.topk)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs) -> torch.Tensor:
        """`x` `[B, S, hidden]`, cos/sin `[B, S, qk_rope_head_dim]` -> `[B, S, hidden]` (cache path: B == 1)."""
        mla, heads = self.mla, self.num_heads
        batch, seq, _ = x.shape
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).unflatten(-1, (heads, mla.qk_head_dim))
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent), k_rope[:, :, None]
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = ROPE_BACKENDS[self.rope_backend](q_rope, k_rope, cos, sin)
        with torch.no_grad():
            index_q, index_k, index_w = self.indexer(x, q_latent, cos, sin, self.rope_backend)
        if attn.cache is not None and attn.cache_batch is not None:
            rows = torch.cat((latent[0, :, None], k_rope[0], index_k[0, :, None]), dim=-1)
            out = self._cached_sparse(q_nope[0], q_rope[0], rows, index_q[0], index_w[0], attn.cache, attn.cache_batch)
        else:
            allowed = _allowed(attn, batch, seq, x.device)
            mask = self._select(index_q, index_k, index_w, allowed)[:, None]  # [B, 1, S, S]
            kv = self.kv_b_proj(latent).unflatten(-1, (heads, -1))
            k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1)
            q_all, k, v = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = sdpa(q_all, k, v, mask, self.scale).transpose(1, 2)
        return self.o_proj(out.reshape(batch, seq, -1))

    def _cached_sparse(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        rows: torch.Tensor,
        index_q: torch.Tensor,
        index_w: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
    ) -> torch.Tensor:
        """Packed new tokens: cache their rows `[T, 1, R + Dr + Di]`, pick each query's top-k among its sequence's
        cached indexer keys, attend in latent space under that mask; each head's output `[T, H, v_head_dim]`."""
        rank, key_dim = self.mla.kv_lora_rank, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        cache.write_keys(self.layer_idx, batch, rows)
        cached = cache.read_keys(self.layer_idx, batch)[:, :, 0]  # [N, max_kv, R + Dr + Di]
        mask = (
            batch.mask
            & self._select(
                index_q[batch.unpack_index], cached[..., key_dim:], index_w[batch.unpack_index], batch.mask[:, 0]
            )[:, None]
        )
        w_k, w_v = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1)).split(
            [self.mla.qk_nope_head_dim, self.mla.v_head_dim], dim=1
        )  # [H, Dn, R], [H, Dv, R]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_k)
        keys = cached[:, :, None, :key_dim]
        out = attend_cached(
            torch.cat((q_latent, q_rope), dim=-1),
            keys,
            keys[..., :rank],
            dataclasses.replace(batch, mask=mask),
            self.scale,
        )
        return torch.einsum("thr,hvr->thv", out, w_v)
