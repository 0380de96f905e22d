"""The within-chunk part of Mamba-2's chunked scan (SSD), forward and backward, as Triton kernels.

`tandem.models.layers.mamba2.chunk_ssd` splits a sequence into chunks of L tokens. Between chunks it passes small
`[P, N]` states; within a chunk each head's output is an attention-like product

    y_l = sum_{s <= l, same segment} (C_l . B_s) exp(cum_l - cum_s) xdt_s

with `cum` the running sum of the log decays `dt * A` from the chunk start. In torch this materialises
`[batch, heads, chunks, L, L]` scores and decays (16K tokens, 128 heads, L = 128: 1 GiB per tensor in fp32, a
few of them per layer kept for the backward). Here the `[L, L]` tiles live in registers only. B and C are shared
by the `heads / groups` heads of a group, so each program owns one chunk and one group, forms `C B^T` once and
loops over the group's heads; the backward sums their `dS` before the two products that give dC and dB (no
atomics, no per-head copies of B and C):

    M = (C B^T) * D          D_ls = exp(cum_l - cum_s) on the causal same-segment pairs, else 0
    dxdt = M^T dy            dM = dy xdt^T            dS += dM * D
    dcum = rowsum(dM * M) - colsum(dM * M)            dC = dS B,   dB = dS^T C

All math is fp32, the products `tandem.kernels.FP32_PRODUCTS` (with fp32 FMAs the backward runs ten times slower).
The decays are
differences of `cum`, as in mamba_ssm's kernels (the torch path's stable segment sums cost an `[L, L]` cumsum).
Dims are padded to powers of two (at least 16) with masked loads; L must be a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels import FP32_PRODUCTS


@triton.jit
def _decays(cum_ptr, seg_ptr, cum_base, seg_base, rows, HAS_SEG: tl.constexpr):
    """D `[L, L]`: exp(cum_l - cum_s) for s <= l in the same segment, else 0."""
    cum = tl.load(cum_ptr + cum_base + rows)
    keep = rows[:, None] >= rows[None, :]
    if HAS_SEG:
        seg = tl.load(seg_ptr + seg_base + rows)
        keep = keep & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(keep, cum[:, None] - cum[None, :], float("-inf")))


@triton.jit
def _intra_forward(
    c_ptr, b_ptr, x_ptr, cum_ptr, seg_ptr, y_ptr,
    chunks, seq, heads, groups, n, p,
    L: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bc, g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    batch, chunk = bc // chunks, bc % chunks
    rows, ns, ps = tl.arange(0, L), tl.arange(0, BN), tl.arange(0, BP)
    tokens = batch * seq + chunk * L + rows  # rows of this chunk in the flattened [batch * seq] tokens
    group_rows = (tokens[:, None] * groups + g) * n + ns[None, :]
    c = tl.load(c_ptr + group_rows, mask=ns[None, :] < n, other=0.0)
    b = tl.load(b_ptr + group_rows, mask=ns[None, :] < n, other=0.0)
    scores = tl.dot(c, tl.trans(b), input_precision=PRECISION)
    per_group = heads // groups
    for j in range(per_group):
        h = g * per_group + j
        cum_base = (batch * heads + h) * seq + chunk * L
        decays = _decays(cum_ptr, seg_ptr, cum_base, batch * seq + chunk * L, rows, HAS_SEG)
        head_rows = (tokens[:, None] * heads + h) * p + ps[None, :]
        x = tl.load(x_ptr + head_rows, mask=ps[None, :] < p, other=0.0)
        y = tl.dot(scores * decays, x, input_precision=PRECISION)
        tl.store(y_ptr + head_rows, y, mask=ps[None, :] < p)


@triton.jit
def _intra_backward(
    c_ptr, b_ptr, x_ptr, cum_ptr, seg_ptr, dy_ptr, dc_ptr, db_ptr, dx_ptr, dcum_ptr,
    chunks, seq, heads, groups, n, p,
    L: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, HAS_SEG: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bc, g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    batch, chunk = bc // chunks, bc % chunks
    rows, ns, ps = tl.arange(0, L), tl.arange(0, BN), tl.arange(0, BP)
    tokens = batch * seq + chunk * L + rows
    group_rows = (tokens[:, None] * groups + g) * n + ns[None, :]
    c = tl.load(c_ptr + group_rows, mask=ns[None, :] < n, other=0.0)
    b = tl.load(b_ptr + group_rows, mask=ns[None, :] < n, other=0.0)
    scores = tl.dot(c, tl.trans(b), input_precision=PRECISION)
    dscores = tl.zeros((L, L), dtype=tl.float32)
    per_group = heads // groups
    for j in range(per_group):
        h = g * per_group + j
        cum_base = (batch * heads + h) * seq + chunk * L
        decays = _decays(cum_ptr, seg_ptr, cum_base, batch * seq + chunk * L, rows, HAS_SEG)
        mixed = scores * decays
        head_rows = (tokens[:, None] * heads + h) * p + ps[None, :]
        x = tl.load(x_ptr + head_rows, mask=ps[None, :] < p, other=0.0)
        dy = tl.load(dy_ptr + head_rows, mask=ps[None, :] < p, other=0.0)
        tl.store(dx_ptr + head_rows, tl.dot(tl.trans(mixed), dy, input_precision=PRECISION), mask=ps[None, :] < p)
        dmixed = tl.dot(dy, tl.trans(x), input_precision=PRECISION)
        dscores += dmixed * decays
        through = dmixed * mixed
        tl.store(dcum_ptr + cum_base + rows, tl.sum(through, axis=1) - tl.sum(through, axis=0))
    tl.store(dc_ptr + group_rows, tl.dot(dscores, b, input_precision=PRECISION), mask=ns[None, :] < n)
    tl.store(db_ptr + group_rows, tl.dot(tl.trans(dscores), c, input_precision=PRECISION), mask=ns[None, :] < n)


def _blocks(n: int, p: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(p))


def _segments(seg: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The segment ids as contiguous int32 `[B, S]`, or a placeholder pointer when there are none."""
    return like if seg is None else seg.to(torch.int32).flatten(1).contiguous()


def intra_forward(
    C: torch.Tensor,
    B: torch.Tensor,
    xdt: torch.Tensor,
    cum: torch.Tensor,
    seg: torch.Tensor | None,
    precision: str = FP32_PRODUCTS,
) -> torch.Tensor:
    """y `[b, c, l, h, p]` from C, B `[b, c, l, g, n]`, xdt `[b, c, l, h, p]`, cum `[b, h, c, l]` (contiguous
    fp32) and seg `[b, 1, c, l]` (segment ids within each chunk, or None)."""
    batch, chunks, size, heads, p = xdt.shape
    groups, n = C.shape[3:]
    bn, bp = _blocks(n, p)
    y = torch.empty_like(xdt)
    _intra_forward[(batch * chunks, groups)](
        C, B, xdt, cum, _segments(seg, cum), y, chunks, chunks * size, heads, groups, n, p,
        L=size, BN=bn, BP=bp, HAS_SEG=seg is not None, PRECISION=precision, num_warps=4, num_stages=1,
    )  # fmt: skip
    return y


def intra_backward(
    C: torch.Tensor,
    B: torch.Tensor,
    xdt: torch.Tensor,
    cum: torch.Tensor,
    seg: torch.Tensor | None,
    dy: torch.Tensor,
    precision: str = FP32_PRODUCTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of (C, B, xdt, cum) from `intra_forward`'s inputs and dy."""
    batch, chunks, size, heads, p = xdt.shape
    groups, n = C.shape[3:]
    bn, bp = _blocks(n, p)
    dC, dB, dx, dcum = (torch.empty_like(t) for t in (C, B, xdt, cum))
    _intra_backward[(batch * chunks, groups)](
        C, B, xdt, cum, _segments(seg, cum), dy.contiguous(), dC, dB, dx, dcum,
        chunks, chunks * size, heads, groups, n, p,
        L=size, BN=bn, BP=bp, HAS_SEG=seg is not None, PRECISION=precision, num_warps=8, num_stages=1,
    )  # fmt: skip
    return dC, dB, dx, dcum


class _IntraChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, C, B, xdt, cum, seg):
        saved = tuple(t.contiguous() for t in (C, B, xdt, cum))
        ctx.save_for_backward(*saved, seg)
        return intra_forward(*saved, seg)

    @staticmethod
    def backward(ctx, dy):
        *saved, seg = ctx.saved_tensors
        return *intra_backward(*saved, seg, dy), None


@torch.compiler.disable  # blocks compiled without fullgraph call it eagerly (a graph break)
def intra_chunk_ssd_triton(
    C: torch.Tensor, B: torch.Tensor, xdt: torch.Tensor, a: torch.Tensor, seg: torch.Tensor | None
) -> torch.Tensor:
    """`tandem.models.layers.mamba2.intra_chunk_ssd` as two Triton kernels (same arguments, fp32)."""
    return _IntraChunk.apply(C, B, xdt, a.cumsum(dim=-1), seg)


@triton.jit
def _ssd_step(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, states_ptr, slots_ptr, fresh_ptr, y_ptr,
    heads, groups, p, n,
    BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    i, h, pb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    g = h // (heads // groups)
    ps, ns = pb * BP + tl.arange(0, BP), tl.arange(0, BN)
    p_mask, n_mask = ps < p, ns < n
    x = tl.load(x_ptr + (i * heads + h) * p + ps, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + (i * groups + g) * n + ns, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + (i * groups + g) * n + ns, mask=n_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i * heads + h).to(tl.float32)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    slot = tl.load(slots_ptr + i)
    offsets = (slot * heads + h) * p * n + ps[:, None] * n + ns[None, :]
    mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(states_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    state = tl.where(tl.load(fresh_ptr + i) != 0, 0.0, state) * decay + (dt * x)[:, None] * b[None, :]
    tl.store(states_ptr + offsets, state.to(states_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + (i * heads + h) * p + ps, y, mask=p_mask)


def ssd_step_triton(
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
    """`tandem.models.layers.mamba2.ssd_step` as one kernel: one program per (sequence, head, block of head dims)
    reads its slice of the slot's state once, advances it by the token, writes it back in place and stores y (fp32)."""
    batch, heads, p = x.shape
    groups, n = B.shape[1:]
    bp, bn = max(16, min(32, triton.next_power_of_2(p))), max(16, triton.next_power_of_2(n))
    y = torch.empty(batch, heads, p, dtype=torch.float32, device=x.device)
    x, dt, A, B, C, D, slots = (t.contiguous() for t in (x, dt, A, B, C, D, slots))  # slots: an inputs column
    _ssd_step[(batch, heads, triton.cdiv(p, bp))](
        x, dt, A, B, C, D, states, slots, fresh.contiguous().view(torch.uint8), y,
        heads, groups, p, n, BP=bp, BN=bn, num_warps=4,
    )  # fmt: skip
    return y
