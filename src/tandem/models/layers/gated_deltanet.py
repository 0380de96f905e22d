"""Gated DeltaNet (Qwen3-Next's `linear_attention` layers), as transformers' `Qwen3NextGatedDeltaNet`.

Per token: `in_proj_qkvz` gives q, k (`num_k_heads` x `k_head_dim`), v and the output gate z (`num_v_heads` x
`v_head_dim`), laid out per key head as HF stores them (`[q, k, v-group, z-group]` per key head); `in_proj_ba` gives
b and a per value head (`[b-group, a-group]` per key head). Qwen3.5 (`flat_projections`) stores them as separate
projections, which the runtime concatenates as `[q, k, v, z]` and `[b, a]`, each of all heads in turn. q, k, v go through a causal depthwise conv
(`conv_kernel` taps, SiLU); q and k are L2-normalised (fp32), q scaled by `k_head_dim ** -0.5`, and each key
head serves `num_v_heads / num_k_heads` consecutive value heads. The memory `S` `[k_head_dim, v_head_dim]` per
value head follows the gated delta rule with `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t

then `norm(o, z)` (RMSNorm times `silu(z)`) and `out_proj`.

Two equal forms of the recurrence, both in fp32: `recurrent_gated_delta_rule` (token by token: the reference and
the decode step) and `chunk_gated_delta_rule` (chunks of 64: matmuls within a chunk, a scan over chunks;
transformers' `torch_chunk_gated_delta_rule`), for training and prefill. The scan over chunks is
`SCAN_BACKENDS[runtime.delta_scan_backend]`: a Python loop (`delta_chunk_scan`) or one Triton launch each way
(`tandem.kernels.delta_scan`, `speed.delta_scan_kernel`).

Documents. Packed rows must behave as their documents run separately. Both forms take `resets` `[B, S]` (True
where a new segment starts: a document start, each padding token) and handle them in place, in the packed layout:
the conv masks the taps that reach back across a start, and in the chunked form a token's decay to any token of
another segment is masked to zero (-inf before the exp), the incoming chunk state only reaches the tokens before
the chunk's first start, and the outgoing state is carried only through chunks without one and gathers only the
chunk's last segment. This is exact (a reset is a decay of 0, which the log-space cumsum cannot express, hence
masks), costs a few elementwise masks, keeps static shapes (no per-document split, no re-layout, compilable) and
keeps the batch parallel. Re-laying documents out as a batch `[documents, longest]` would pad every document
to the longest one, which for packed rows is many times the tokens.

Cached steps (prefill chunks and decode, `StateCache`): the step's packed tokens are unpacked per sequence
(`CacheBatch.unpack_index`), the conv continues from the cached last inputs and the recurrence from the cached
state; padded slots get `g = 0` and `beta = 0`, so they leave the state unchanged and the final state is the one
after each sequence's last token. A decode step (one token each) hands the cache's state tensor itself to
`STEP_BACKENDS[runtime.delta_scan_backend]`, which advances every sequence's state in its slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import Fused, HFLayout, WeightMap, same_names
from ..runtime import ModelRuntime
from .norm import GatedRMSNorm
from .state_cache import read_slots, write_slots


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (transformers' and FLA's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """fp32 `[B, H_v, S, ...]` tensors: q, k repeated to the value heads and L2-normalised, q scaled."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k `[B, S, Hk, dk]`, v `[B, S, Hv, dv]`, g, beta `[B, S, Hv]`, resets `[B, S]` bool (state
    zeroed before a True token), initial_state `[B, Hv, dk, dv]`. Returns `[B, S, Hv, dv]` (v's dtype) and the
    final state (fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, seq, dk = k.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    decay = g.exp()
    if resets is not None:
        decay = decay * (~resets)[:, None, :]
    outs = []
    for t in range(seq):
        state = state * decay[:, :, t, None, None]
        k_t = k[:, :, t]
        memory = (state * k_t[..., None]).sum(dim=-2)
        delta = (v[:, :, t] - memory) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    return torch.stack(outs, dim=1).to(dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    scan: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of `recurrent_gated_delta_rule` (same arguments and results; `scan` names the pass over chunks
    in `SCAN_BACKENDS`); see the module docstring."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    seq = k.shape[2]
    pad = (chunk_size - seq % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))  # padded tokens: no decay, no update
    chunks = (seq + pad) // chunk_size
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.unflatten(2, (chunks, chunk_size)) for t in (q, k, k_beta, v_beta))
    cum = g.unflatten(2, (chunks, chunk_size)).cumsum(dim=-1)  # [B, H, n, C] log decay from the chunk start
    blocked: torch.Tensor = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    carry = last_segment = None
    if resets is not None:
        # segment index within the chunk: 0 = the segment the chunk inherits from the previous one
        seg = F.pad(resets, (0, pad)).unflatten(1, (chunks, chunk_size)).long().cumsum(dim=-1)[:, None]
        blocked = blocked | (seg[..., :, None] != seg[..., None, :])
        carry = (seg == 0).float()
        last_segment = (seg == seg[..., -1:]).float()
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(blocked, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decay_in = cum.exp() if carry is None else cum.exp() * carry
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * decay_in[..., None], upper=False, unitriangular=True)
    q = q * decay_in[..., None]
    decay_out = (cum[..., -1:] - cum).exp()
    k = k * (decay_out if last_segment is None else decay_out * last_segment)[..., None]
    chunk_decay = cum[..., -1].exp()
    if carry is not None:
        chunk_decay = chunk_decay * carry[..., -1]
    state = None if initial_state is None else initial_state.float()
    out, state = SCAN_BACKENDS[scan](new_values, k_cumdecay, q, intra, k, chunk_decay, state)
    out = out.flatten(2, 3)[:, :, :seq]
    return out.transpose(1, 2).to(dtype), state


def delta_chunk_scan(
    u: torch.Tensor,
    w: torch.Tensor,
    q: torch.Tensor,
    a: torch.Tensor,
    k: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over chunks, fp32, per (batch, head) and chunk i with the state S `[dk, dv]` entering it:
    `v = u_i - w_i @ S`, `out_i = q_i @ S + a_i @ v`, `S <- decay_i * S + k_i^T @ v`. u `[B, H, n, C, dv]`, w, q,
    k `[B, H, n, C, dk]`, a `[B, H, n, C, C]`, decay `[B, H, n]`; returns out `[B, H, n, C, dv]` and the last S.
    (`tandem.kernels.delta_scan` runs it as one Triton launch each way.)"""
    batch, heads, chunks, _, dv = u.shape
    state = u.new_zeros(batch, heads, w.shape[-1], dv) if initial_state is None else initial_state
    outs = []
    for i in range(chunks):
        v = u[:, :, i] - w[:, :, i] @ state
        outs.append(q[:, :, i] @ state + a[:, :, i] @ v)
        state = state * decay[:, :, i, None, None] + k[:, :, i].transpose(-1, -2) @ v
    return torch.stack(outs, dim=2), state


ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
SCAN_BACKENDS: dict[str, ScanFn] = {"torch": delta_chunk_scan}
"""The pass over chunks by name: `delta_chunk_scan`, or a Triton kernel registered by its user
(`tandem.kernels.delta_scan.delta_chunk_scan_triton`; this package imports no kernel)."""


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence on the state cache, in place: q, k `[N, Hk, dk]`, v `[N, Hv, dv]`, g, beta `[N, Hv]`
    (raw, as `recurrent_gated_delta_rule` takes them), states `[slots, Hv, dk, dv]` (a layer's
    `StateCache.recurrent`), slots `[N]`, fresh `[N]` bool (start from zero). Returns `[N, Hv, dv]` (v's dtype);
    each slot then holds its state after the token."""
    state = read_slots(states, slots, fresh)
    out, state = recurrent_gated_delta_rule(*(t[:, None] for t in (q, k, v, g, beta)), initial_state=state)
    write_slots(states, slots, state)
    return out[:, 0]


STEP_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"torch": gated_delta_step}
"""The decode step by `delta_scan_backend` name: `gated_delta_step`, or the Triton kernel registered with the
scan (`tandem.kernels.delta_scan.gated_delta_step_triton`: the state read and written once, in its slot)."""


def segment_offsets(resets: torch.Tensor) -> torch.Tensor:
    """`[B, S]`: how many tokens of its own segment precede each token (0 at a start)."""
    index = torch.arange(resets.shape[1], device=resets.device).expand_as(resets)
    return index - torch.where(resets, index, torch.zeros_like(index)).cummax(dim=1).values


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    resets: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU of the causal depthwise conv of `x` `[B, S, C]` with `weight` `[C, 1, K]` (transformers' conv1d with
    `K - 1` left padding) plus `bias` `[C]` if given; taps reaching back across a segment start are masked; `state`
    `[B, C, K - 1]`: the inputs before `x` (cache), else zeros."""
    taps, seq = weight.shape[-1], x.shape[1]
    w = weight[:, 0].to(x.dtype)  # [C, K]
    before = x.new_zeros(x.shape[0], taps - 1, x.shape[2]) if state is None else state.transpose(1, 2).to(x.dtype)
    padded = torch.cat([before, x], dim=1)
    offsets = None if resets is None else segment_offsets(resets)
    out = x * w[:, -1]
    if bias is not None:
        out = out + bias.to(x.dtype)
    for lag in range(1, taps):
        term = padded[:, taps - 1 - lag : taps - 1 - lag + seq] * w[:, -1 - lag]
        out = out + (term if offsets is None else term * (offsets >= lag)[..., None])
    return F.silu(out)


def next_conv_state(state: torch.Tensor, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The conv state `[N, C, K - 1]` after a cached step: each sequence's last `K - 1` inputs, from the state before
    it and the step's inputs `x` `[N, max_new, C]`, of which sequence n has `lengths[n]`."""
    taps = state.shape[-1] + 1
    history = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [N, K - 1 + max_new, C]
    keep = lengths[:, None] + torch.arange(taps - 1, device=x.device)
    return history.gather(1, keep[..., None].expand(-1, -1, history.shape[-1])).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer, HF parameter names (`linear_attn.*`): `in_proj_qkvz`, `in_proj_ba`,
    `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`. Same call as the attention modules."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        la = args.linear
        assert la is not None
        self.layer_idx, self.chunk_size, self.scan = layer_idx, la.chunk_size, runtime.delta_scan_backend
        self.flat_projections, self.conv_dim = la.flat_projections, la.conv_dim
        self.num_k_heads, self.num_v_heads = la.num_k_heads, la.num_v_heads
        self.k_head_dim, self.v_head_dim = la.k_head_dim, la.v_head_dim
        key_dim, value_dim = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
        self.in_proj_qkvz = nn.Linear(args.hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(args.hidden_size, 2 * la.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_v_heads))
        self.norm = GatedRMSNorm(la.v_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, args.hidden_size, bias=False)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """HF's names and layouts; Qwen3.5's separate input projections (`LinearAttnArgs.flat_projections`) are
        concatenated into `in_proj_qkvz` (`in_proj_qkv`, `in_proj_z`) and `in_proj_ba` (`in_proj_b`, `in_proj_a`)."""
        la = args.linear
        assert la is not None
        out = same_names("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
        if not la.flat_projections:
            return out | same_names("in_proj_qkvz.weight", "in_proj_ba.weight")
        qkvz = tuple(f"in_proj_{p}.weight" for p in ("qkv", "z"))
        out["in_proj_qkvz.weight"] = Fused((qkvz,), (la.conv_dim, la.num_v_heads * la.v_head_dim))
        out["in_proj_ba.weight"] = Fused((tuple(f"in_proj_{p}.weight" for p in "ba"),), (la.num_v_heads,) * 2)
        return out

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """transformers' init for the decay parameters: `dt_bias` ones, `A_log = log(U(0.01, 16))`."""
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16, generator=generator).log())

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv input `[..., conv_dim]` (q, k, v flattened), z `[..., Hv, dv]`, b and a `[..., Hv]`."""
        group = self.num_v_heads // self.num_k_heads
        dk, dv = self.k_head_dim, self.v_head_dim
        if self.flat_projections:  # Qwen3.5: [q, k, v, z] and [b, a], each of all heads in turn
            mixed, z = self.in_proj_qkvz(x).split((self.conv_dim, self.num_v_heads * dv), dim=-1)
            b, a = self.in_proj_ba(x).chunk(2, dim=-1)
            return mixed, z.unflatten(-1, (self.num_v_heads, dv)), b, a
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.num_k_heads, -1))
        q, k, v, z = qkvz.split((dk, dk, group * dv, group * dv), dim=-1)
        b, a = self.in_proj_ba(x).unflatten(-1, (self.num_k_heads, -1)).split((group, group), dim=-1)
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        return mixed, z.reshape(*z.shape[:-2], self.num_v_heads, dv), b.flatten(-2), a.flatten(-2)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key_dim = self.num_k_heads * self.k_head_dim
        q, k, v = mixed.split((key_dim, key_dim, self.num_v_heads * self.v_head_dim), dim=-1)
        return (
            q.unflatten(-1, (-1, self.k_head_dim)),
            k.unflatten(-1, (-1, self.k_head_dim)),
            v.unflatten(-1, (-1, self.v_head_dim)),
        )

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(out, z).flatten(-2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: object) -> torch.Tensor:
        """`x` `[B, S, hidden]` -> `[B, S, hidden]`; `attn` is the forward's `AttnInputs` (its `resets`, or its
        state cache for a cached step; cos/sin are unused)."""
        if getattr(attn, "state", None) is not None:
            return self._cached(x, attn)
        resets = getattr(attn, "resets", None)
        mixed, z, b, a = self._project(x)
        q, k, v = self._heads(causal_conv(mixed, self.conv1d.weight, resets))
        g, beta = self._gates(b, a)
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, resets, chunk_size=self.chunk_size, scan=self.scan)
        return self._output(out, z)

    def _cached(self, x: torch.Tensor, attn: object) -> torch.Tensor:
        """A cached step: `x` `[1, T, hidden]` packed; each sequence continues from its slot's state."""
        batch, store, step = attn.cache_batch, attn.state, attn.state_batch  # type: ignore[attr-defined]
        unpack = batch.unpack_index  # [N, max_new]
        max_new = unpack.shape[1]
        valid = unpack == unpack[:, :1] + torch.arange(max_new, device=x.device)
        mixed, z, b, a = (t[0][unpack] for t in self._project(x))
        conv_state = store.read_conv(self.layer_idx, step)
        q, k, v = self._heads(causal_conv(mixed, self.conv1d.weight, state=conv_state))
        g, beta = self._gates(b, a)
        g, beta = g * valid[..., None], beta * valid[..., None]  # padded slots keep the state as it is
        if max_new == 1:  # decode: the state is advanced in its slot
            states = store.recurrent[self.layer_idx]
            out = STEP_BACKENDS[self.scan](*(t[:, 0] for t in (q, k, v, g, beta)), states, step.slots, step.fresh)
            out = out[:, None]
        else:
            state = store.read_recurrent(self.layer_idx, step)
            out, state = chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=state, chunk_size=self.chunk_size, scan=self.scan
            )
            store.write_recurrent(self.layer_idx, step, state)
        store.write_conv(self.layer_idx, step, next_conv_state(conv_state, mixed, valid.sum(dim=1)))
        out = out.flatten(0, 1)[batch.pack_index]
        z = z.flatten(0, 1)[batch.pack_index]
        return self._output(out, z)[None]
