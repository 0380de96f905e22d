"""Mamba-2 (Nemotron-H's `mamba` layers), as transformers' `NemotronHMamba2Mixer` (its torch path).

Per token: `in_proj` gives, in this order, the gate z (`num_heads * head_dim`), the conv input xBC (x, then B and C of
`n_groups * state_size` each) and dt (`num_heads`). xBC goes through a causal depthwise conv (`conv_kernel` taps, a
bias, SiLU). With `dt = clamp(softplus(dt + dt_bias), dt_limit)` and `A = -exp(A_log)` per head, each head's state
`h` `[head_dim, state_size]` follows (B and C of a group serve `num_heads / n_groups` consecutive heads)

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

then the gated grouped RMSNorm (`x * silu(z)` first, then normalised per group; `norm_before_gate=False`) and
`out_proj`. The scan, the norm and everything between them run in fp32.

Two equal forms, fp32: `recurrent_ssd` (token by token: the reference and the decode step) and `chunk_ssd` (SSD:
within a chunk a masked attention-like product, between chunks the same over chunk states: one matmul by the
decays between every pair of chunks, no loop; transformers' `mamba2_chunk_scan`), for training and prefill. The
within-chunk part is `SSD_BACKENDS[runtime.ssd_backend]`: torch einsums over `[L, L]` scores, or Triton kernels that
keep those tiles in registers (`tandem.kernels.ssd`, `speed.ssd_kernel`).

Documents: as `layers.gated_deltanet`, both forms take `resets` `[B, S]` (True at a document start and at every
padding token) and keep documents apart in the packed layout: the conv masks taps that reach back across a start,
and the chunked form masks intra-chunk decays between segments, lets the incoming chunk state reach only the tokens
before the chunk's first start, and carries out of a chunk only its last segment. Cached steps unpack the step's
tokens per sequence and continue from the slot's conv inputs and SSM state (`StateCache`); padded positions get
`dt = 0`, which leaves the state unchanged. A decode step advances each state in its slot through
`SSD_STEP_BACKENDS[runtime.ssd_backend]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import HFLayout, WeightMap, same_names
from ..runtime import ModelRuntime
from .gated_deltanet import causal_conv, next_conv_state
from .norm import GroupedGatedRMSNorm
from .state_cache import read_slots, write_slots


def _heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, S, G, N]` -> `[B, S, heads, N]` fp32, each group serving `heads / G` consecutive heads."""
    return t.float().repeat_interleave(heads // t.shape[2], dim=2)


def recurrent_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. x `[B, S, H, P]`, dt `[B, S, H]` (after softplus and clamp), A and D `[H]`, B and C
    `[B, S, G, N]`, resets `[B, S]` bool (state zeroed before a True token), initial_state `[B, H, P, N]`.
    Returns y `[B, S, H, P]` and the final state, both fp32."""
    heads = x.shape[2]
    x, dt, B, C = x.float(), dt.float(), _heads_of_groups(B, heads), _heads_of_groups(C, heads)
    batch, seq, _, dim = x.shape
    state = x.new_zeros(batch, heads, dim, B.shape[-1]) if initial_state is None else initial_state.float()
    decay = (dt * A.float()).exp()
    if resets is not None:
        decay = decay * (~resets)[..., None]
    outs = []
    for t in range(seq):
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = state * decay[:, t, :, None, None] + update
        outs.append((state * C[:, t, :, None, :]).sum(-1) + D.float()[:, None] * x[:, t])
    return torch.stack(outs, dim=1), state


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """`[..., L]` -> `[..., L, L]`: entry (l, s) = `a[s+1] + ... + a[l]` for s <= l, -inf above the diagonal
    (transformers' stable form: masked cumulative sums, not differences of one cumsum)."""
    size = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, size)
    below = torch.ones(size, size, dtype=torch.bool, device=a.device).tril(-1)
    sums = expanded.masked_fill(~below, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(size, size, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def intra_chunk_ssd(
    C: torch.Tensor, B: torch.Tensor, xdt: torch.Tensor, a: torch.Tensor, seg: torch.Tensor | None
) -> torch.Tensor:
    """The within-chunk outputs `[b, c, l, h, p]`: C, B `[b, c, l, g, n]`, xdt `[b, c, l, h, p]`, the log decays
    a `[b, h, c, l]` and seg `[b, 1, c, l]` (segment ids within each chunk, or None), all fp32. `C B^T` is formed
    per group, the decays per head."""
    per_group = xdt.shape[3] // C.shape[3]
    decays = segment_sum(a)  # [b, h, c, l, s]
    if seg is not None:
        decays = decays.masked_fill(seg[..., :, None] != seg[..., None, :], float("-inf"))
    scores = torch.einsum("bclgn,bcsgn->bgcls", C, B).repeat_interleave(per_group, dim=1) * decays.exp()
    return torch.einsum("bhcls,bcshp->bclhp", scores, xdt)


IntraChunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
SSD_BACKENDS: dict[str, IntraChunk] = {"torch": intra_chunk_ssd}
"""`chunk_ssd`'s within-chunk part by `ssd_backend` name; the trainer registers "triton"
(`tandem.kernels.ssd.intra_chunk_ssd_triton`; this package imports no kernel).

The kernels run chunks of `KERNEL_CHUNK` tokens whatever the config's `chunk_size`: the chunk length only splits
the same sums (equal results in exact arithmetic), and at 64 a chunk's `[L, L]` tiles fit in registers."""
KERNEL_CHUNK = 64


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 128,
    intra: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of `recurrent_ssd` (same arguments and results; `intra` names the within-chunk part in
    `SSD_BACKENDS`); see the module docstring."""
    heads = x.shape[2]
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    batch, seq, _, dim = x.shape
    skip = D.float()[:, None] * x
    pad = (chunk_size - seq % chunk_size) % chunk_size
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))  # padded tokens: no decay, no update
    chunks = (seq + pad) // chunk_size
    xdt = (x * dt[..., None]).unflatten(1, (chunks, chunk_size))  # [b, c, l, h, p]
    B, C = B.unflatten(1, (chunks, chunk_size)), C.unflatten(1, (chunks, chunk_size))  # [b, c, l, g, n]
    a = (dt * A.float()).unflatten(1, (chunks, chunk_size)).permute(0, 3, 1, 2)  # [b, h, c, l] log decays
    cum = a.cumsum(dim=-1)
    seg = carry = last_segment = None
    if resets is not None:
        # segment index within the chunk: 0 = the segment the chunk inherits from the previous one
        seg = F.pad(resets, (0, pad)).unflatten(1, (chunks, chunk_size)).long().cumsum(dim=-1)[:, None]  # [b,1,c,l]
        carry = (seg == 0).float()
        last_segment = (seg == seg[..., -1:]).float()
    y_diag = SSD_BACKENDS[intra](C, B, xdt, a, seg)
    groups = B.shape[3]
    decay_out = (cum[..., -1:] - cum).exp()
    if last_segment is not None:
        decay_out = decay_out * last_segment
    # Heads as (group, head in group), so B and C are never copied per head: [b, c, l, g, j, p] by [b, c, l, g, n].
    decayed = (xdt * decay_out.permute(0, 2, 3, 1)[..., None]).unflatten(3, (groups, -1))
    chunk_states = torch.einsum("bclgjp,bclgn->bcgjpn", decayed, B).flatten(2, 3)  # [b, c, h, p, n]
    decay_in = cum.exp() if carry is None else cum.exp() * carry  # [b, h, c, l]
    # The state entering chunk i: the initial state and every earlier chunk's own state, each decayed through the
    # chunks between (`transfer`, the segment sums over chunks, as within a chunk); a chunk holding a segment start
    # passes nothing through. One matmul instead of a loop over chunks.
    transfer = segment_sum(F.pad(cum[..., -1], (1, 0)))  # [b, h, c + 1, c + 1]
    if carry is not None:
        crossed = segment_sum(F.pad(1.0 - carry[..., -1], (1, 0)))  # starts between: > 0 blocks
        transfer = transfer.masked_fill(crossed > 0, float("-inf"))
    state = x.new_zeros(batch, heads, dim, B.shape[-1]) if initial_state is None else initial_state.float()
    entering = torch.einsum("bhzc,bchpn->bzhpn", transfer.exp(), torch.cat([state[:, None], chunk_states], dim=1))
    y_off = torch.einsum("bclgn,bcgjpn->bclgjp", C, entering[:, :-1].unflatten(2, (groups, -1))).flatten(3, 4)
    y_off = y_off * decay_in.permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).flatten(1, 2)[:, :seq]
    return y + skip, entering[:, -1]


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence on the state cache, in place: x `[N, H, P]`, dt `[N, H]` (after softplus and clamp),
    A and D `[H]`, B and C `[N, G, N_state]`, states `[slots, H, P, N_state]` (a layer's `StateCache.recurrent`),
    slots `[N]`, fresh `[N]` bool (start from zero). Returns y `[N, H, P]` fp32; each slot then holds its state
    after the token."""
    state = read_slots(states, slots, fresh)
    y, state = recurrent_ssd(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, initial_state=state)
    write_slots(states, slots, state)
    return y[:, 0]


SSD_STEP_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"torch": ssd_step}
"""The decode step by `ssd_backend` name: `ssd_step`, or the Triton kernel registered with the within-chunk ones
(`tandem.kernels.ssd.ssd_step_triton`: the state read and written once, in its slot)."""


class Mamba2(nn.Module):
    """The Mamba-2 token mixer, HF parameter names (`mixer.*`): `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`. Same call as the attention modules."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        m = args.mamba
        assert m is not None
        self.layer_idx, self.dt_limit, self.ssd = layer_idx, m.dt_limit, runtime.ssd_backend
        self.chunk_size = m.chunk_size if self.ssd == "torch" else KERNEL_CHUNK
        self.num_heads, self.head_dim, self.n_groups, self.state_size = (
            m.num_heads,
            m.head_dim,
            m.n_groups,
            m.state_size,
        )
        self.inner, self.conv_dim = m.inner_size, m.conv_dim
        self.time_step = (m.time_step_min, m.time_step_max, m.time_step_floor)
        self.in_proj = nn.Linear(args.hidden_size, self.inner + self.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            m.conv_kernel,
            groups=self.conv_dim,
            bias=m.conv_bias,
            padding=m.conv_kernel - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(m.num_heads))
        self.A_log = nn.Parameter(torch.zeros(m.num_heads))
        self.D = nn.Parameter(torch.ones(m.num_heads))
        self.norm = GroupedGatedRMSNorm(self.inner, m.n_groups, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, args.hidden_size, bias=m.proj_bias)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """HF's names and layouts, unchanged."""
        m = args.mamba
        assert m is not None
        names = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]
        names += ["conv1d.bias"] if m.conv_bias else []
        names += ["in_proj.bias", "out_proj.bias"] if m.proj_bias else []
        return same_names(*names)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """transformers' init: `A_log = log(1..H)`, `D` ones, `dt_bias` the inverse softplus of a log-uniform dt in
        `[time_step_min, time_step_max]` (floored); the conv bias zero."""
        low, high, floor = self.time_step
        with torch.no_grad():
            self.A_log.copy_(torch.arange(1, self.num_heads + 1, dtype=torch.float32).log())
            self.D.fill_(1.0)
            rand = torch.rand(self.num_heads, generator=generator, device=self.dt_bias.device)
            dt = (rand * (math.log(high) - math.log(low)) + math.log(low)).exp().clamp(min=floor)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if self.conv1d.bias is not None:
                self.conv1d.bias.zero_()

    def _split(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z `[..., inner]`, xBC `[..., conv_dim]`, dt `[..., H]`."""
        z, xbc, dt = projected.split((self.inner, self.conv_dim, self.num_heads), dim=-1)
        return z, xbc, dt

    def _scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x `[..., H, P]`, dt (fp32, softplus and clamp), B and C `[..., G, N]` from the conv output and raw dt."""
        size = self.n_groups * self.state_size
        x, B, C = xbc.split((self.inner, size, size), dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.dt_limit).float()
        return (
            x.unflatten(-1, (self.num_heads, self.head_dim)),
            dt,
            B.unflatten(-1, (self.n_groups, self.state_size)),
            C.unflatten(-1, (self.n_groups, self.state_size)),
        )

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.out_proj(self.norm(y.flatten(-2), z).to(dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: object) -> torch.Tensor:
        """`x` `[B, S, hidden]` -> `[B, S, hidden]`; `attn` is the forward's `AttnInputs` (its `resets`, or its
        state cache for a cached step; cos/sin are unused)."""
        if getattr(attn, "state", None) is not None:
            return self._cached(x, attn)
        resets = getattr(attn, "resets", None)
        z, xbc, dt = self._split(self.in_proj(x))
        xbc = causal_conv(xbc, self.conv1d.weight, resets, bias=self.conv1d.bias)
        xs, dt, B, C = self._scan_inputs(xbc, dt)
        A = -self.A_log.float().exp()
        y, _ = chunk_ssd(xs, dt, A, B, C, self.D, resets, chunk_size=self.chunk_size, intra=self.ssd)
        return self._output(y, z, x.dtype)

    def _cached(self, x: torch.Tensor, attn: object) -> torch.Tensor:
        """A cached step: `x` `[1, T, hidden]` packed; each sequence continues from its slot's state."""
        batch, store, step = attn.cache_batch, attn.state, attn.state_batch  # type: ignore[attr-defined]
        unpack = batch.unpack_index  # [N, max_new]
        max_new = unpack.shape[1]
        valid = unpack == unpack[:, :1] + torch.arange(max_new, device=x.device)
        z, xbc, dt = (t[0][unpack] for t in self._split(self.in_proj(x)))
        conv_state = store.read_conv(self.layer_idx, step)
        conv_out = causal_conv(xbc, self.conv1d.weight, state=conv_state, bias=self.conv1d.bias)
        xs, dt, B, C = self._scan_inputs(conv_out, dt)
        dt = dt * valid[..., None]  # padded positions keep the state as it is
        A = -self.A_log.float().exp()
        if max_new == 1:  # decode: the state is advanced in its slot
            states = store.recurrent[self.layer_idx]
            inputs = (xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.D)
            y = SSD_STEP_BACKENDS[self.ssd](*inputs, states, step.slots, step.fresh)[:, None]
        else:
            state = store.read_recurrent(self.layer_idx, step)
            y, state = chunk_ssd(xs, dt, A, B, C, self.D, None, state, chunk_size=self.chunk_size, intra=self.ssd)
            store.write_recurrent(self.layer_idx, step, state)
        store.write_conv(self.layer_idx, step, next_conv_state(conv_state, xbc, valid.sum(dim=1)))
        y = y.flatten(0, 1)[batch.pack_index]
        z = z.flatten(0, 1)[batch.pack_index]
        return self._output(y, z, x.dtype)[None]
