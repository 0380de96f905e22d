"""The pass over chunks of the chunked gated delta rule (Gated DeltaNet), forward and backward, as Triton kernels.

`tandem.models.layers.gated_deltanet.chunk_gated_delta_rule` turns a sequence into chunks of C tokens and computes
everything within a chunk with batched matmuls; what is left is a recurrence over chunks, which the plain-torch
`delta_chunk_scan` runs as a Python loop of five small matmuls a chunk (and autograd of it backwards: a few
hundred launches each way at 16K tokens). Per (batch, head) and chunk i, with the state S `[dk, dv]` entering it:

    v_i     = u_i - w_i @ S            the chunk's values once the state's prediction is removed  [C, dv]
    o_i     = q_i @ S + a_i @ v_i      its output                                                  [C, dv]
    S      <- decay_i * S + k_i^T @ v_i

Here one program owns one (batch, head) and a block of BV value columns (the recurrence never mixes value
columns), keeps its `[dk, BV]` slice of S in registers and walks the chunks in one launch; it stores the state
entering every chunk for the backward. The backward walks the chunks in reverse with dS, recomputing v_i from the
stored state:

    dv_i = a_i^T @ do_i + k_i @ dS            du_i = dv_i
    da_i = do_i @ v_i^T      dq_i = do_i @ S^T      dk_i = v_i @ dS^T      dw_i = -dv_i @ S^T
    ddecay_i = sum(S * dS)   dS  <- decay_i * dS + q_i^T @ do_i - w_i^T @ dv_i

The terms that sum over value columns (da, dq, dk, dw, ddecay) are written per value block and summed after.
All math is fp32, the products `tandem.kernels.FP32_PRODUCTS` (fp32-close on tensor cores: the trainer and the
engine must score the numbers the reference does; fp32 FMAs would spill, the backward keeping a dozen tiles live).
Dims are padded to powers of two (at least 16) with masked loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels import FP32_PRODUCTS


@triton.jit
def _scan_forward(
    u_ptr, w_ptr, q_ptr, a_ptr, k_ptr, decay_ptr, init_ptr, out_ptr, states_ptr, final_ptr,
    chunks, dk, dv,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh, vb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows, ks = tl.arange(0, C), tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < dk, vs < dv
    state_offsets = ks[:, None] * dv + vs[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + bh * dk * dv + state_offsets, mask=state_mask, other=0.0)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    for i in range(chunks):
        chunk = bh * chunks + i
        tl.store(states_ptr + chunk * dk * dv + state_offsets, state, mask=state_mask)
        kd = chunk * C * dk + rows[:, None] * dk + ks[None, :]
        vd = chunk * C * dv + rows[:, None] * dv + vs[None, :]
        w = tl.load(w_ptr + kd, mask=k_mask[None, :], other=0.0)
        u = tl.load(u_ptr + vd, mask=v_mask[None, :], other=0.0)
        v = u - tl.dot(w, state, input_precision=PRECISION)
        q = tl.load(q_ptr + kd, mask=k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + chunk * C * C + rows[:, None] * C + rows[None, :])
        out = tl.dot(q, state, input_precision=PRECISION) + tl.dot(a, v, input_precision=PRECISION)
        tl.store(out_ptr + vd, out, mask=v_mask[None, :])
        k = tl.load(k_ptr + kd, mask=k_mask[None, :], other=0.0)
        decay = tl.load(decay_ptr + chunk)
        state = state * decay + tl.dot(tl.trans(k), v, input_precision=PRECISION)
    tl.store(final_ptr + bh * dk * dv + state_offsets, state, mask=state_mask)


@triton.jit
def _scan_backward(
    u_ptr, w_ptr, q_ptr, a_ptr, k_ptr, decay_ptr, states_ptr, dout_ptr, dfinal_ptr,
    du_ptr, dw_ptr, dq_ptr, da_ptr, dk_ptr, ddecay_ptr, dinit_ptr,
    chunks, dk, dv, kd_part, cc_part, decay_part,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh, vb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows, ks = tl.arange(0, C), tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < dk, vs < dv
    state_offsets = ks[:, None] * dv + vs[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    part = vb.to(tl.int64)  # this value block's copy of the terms summed over value blocks
    dstate = tl.load(dfinal_ptr + bh * dk * dv + state_offsets, mask=state_mask, other=0.0)
    for step in range(chunks):
        i = chunks - 1 - step
        chunk = bh * chunks + i
        state = tl.load(states_ptr + chunk * dk * dv + state_offsets, mask=state_mask, other=0.0)
        kd = chunk * C * dk + rows[:, None] * dk + ks[None, :]
        vd = chunk * C * dv + rows[:, None] * dv + vs[None, :]
        cc = chunk * C * C + rows[:, None] * C + rows[None, :]
        w = tl.load(w_ptr + kd, mask=k_mask[None, :], other=0.0)
        u = tl.load(u_ptr + vd, mask=v_mask[None, :], other=0.0)
        v = u - tl.dot(w, state, input_precision=PRECISION)
        q = tl.load(q_ptr + kd, mask=k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + cc)
        k = tl.load(k_ptr + kd, mask=k_mask[None, :], other=0.0)
        dout = tl.load(dout_ptr + vd, mask=v_mask[None, :], other=0.0)
        dv_i = tl.dot(tl.trans(a), dout, input_precision=PRECISION) + tl.dot(k, dstate, input_precision=PRECISION)
        tl.store(du_ptr + vd, dv_i, mask=v_mask[None, :])
        tl.store(da_ptr + part * cc_part + cc, tl.dot(dout, tl.trans(v), input_precision=PRECISION))
        kd_out = part * kd_part + kd
        tl.store(dq_ptr + kd_out, tl.dot(dout, tl.trans(state), input_precision=PRECISION), mask=k_mask[None, :])
        tl.store(dk_ptr + kd_out, tl.dot(v, tl.trans(dstate), input_precision=PRECISION), mask=k_mask[None, :])
        tl.store(dw_ptr + kd_out, -tl.dot(dv_i, tl.trans(state), input_precision=PRECISION), mask=k_mask[None, :])
        tl.store(ddecay_ptr + part * decay_part + chunk, tl.sum(state * dstate))
        decay = tl.load(decay_ptr + chunk)
        dstate = (
            dstate * decay
            + tl.dot(tl.trans(q), dout, input_precision=PRECISION)
            - tl.dot(tl.trans(w), dv_i, input_precision=PRECISION)
        )
    tl.store(dinit_ptr + bh * dk * dv + state_offsets, dstate, mask=state_mask)


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    """(BK, BV): the whole key dim and value blocks of at most 32 columns, powers of two of at least 16."""
    return max(16, triton.next_power_of_2(dk)), max(16, min(32, triton.next_power_of_2(dv)))


def scan_forward(
    u: torch.Tensor,
    w: torch.Tensor,
    q: torch.Tensor,
    a: torch.Tensor,
    k: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None,
    precision: str = FP32_PRODUCTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out `[B, H, n, C, dv]`, the final state and the state entering every chunk `[B, H, n, dk, dv]`."""
    batch, heads, chunks, size, dv = u.shape
    dk = w.shape[-1]
    bk, bv = _blocks(dk, dv)
    out = torch.empty_like(u)
    states = torch.empty(batch, heads, chunks, dk, dv, dtype=torch.float32, device=u.device)
    final = torch.empty(batch, heads, dk, dv, dtype=torch.float32, device=u.device)
    init = initial_state.contiguous() if initial_state is not None else final
    _scan_forward[(batch * heads, triton.cdiv(dv, bv))](
        u, w, q, a, k, decay, init, out, states, final, chunks, dk, dv,
        C=size, BK=bk, BV=bv, HAS_INIT=initial_state is not None, PRECISION=precision, num_warps=4, num_stages=1,
    )  # fmt: skip
    return out, final, states


def scan_backward(
    saved: tuple[torch.Tensor, ...],
    states: torch.Tensor,
    dout: torch.Tensor,
    dfinal: torch.Tensor,
    precision: str = FP32_PRODUCTS,
) -> tuple[torch.Tensor, ...]:
    """The gradients of (u, w, q, a, k, decay, initial state) from `scan_forward`'s inputs `saved` and `states`."""
    u, w, q, a, k, decay = saved
    batch, heads, chunks, size, dv = u.shape
    dk = w.shape[-1]
    bk, bv = _blocks(dk, dv)
    blocks = triton.cdiv(dv, bv)
    du = torch.empty_like(u)
    dw, dq, dk_ = (torch.empty(blocks, *w.shape, dtype=torch.float32, device=u.device) for _ in range(3))
    da = torch.empty(blocks, *a.shape, dtype=torch.float32, device=u.device)
    ddecay = torch.empty(blocks, *decay.shape, dtype=torch.float32, device=u.device)
    dinit = torch.empty(batch, heads, dk, dv, dtype=torch.float32, device=u.device)
    _scan_backward[(batch * heads, blocks)](
        u, w, q, a, k, decay, states, dout.contiguous(), dfinal.contiguous(),
        du, dw, dq, da, dk_, ddecay, dinit, chunks, dk, dv, w.numel(), a.numel(), decay.numel(),
        C=size, BK=bk, BV=bv, PRECISION=precision, num_warps=4, num_stages=1,
    )  # fmt: skip
    return du, dw.sum(0), dq.sum(0), da.sum(0), dk_.sum(0), ddecay.sum(0), dinit


class _DeltaChunkScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, q, a, k, decay, initial_state):
        saved = tuple(t.contiguous() for t in (u, w, q, a, k, decay))
        out, final, states = scan_forward(*saved, initial_state)
        ctx.save_for_backward(*saved, states)
        ctx.has_init = initial_state is not None
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        *saved, states = ctx.saved_tensors
        *grads, dinit = scan_backward(tuple(saved), states, dout, dfinal)
        return *grads, dinit if ctx.has_init else None


@torch.compiler.disable  # blocks compiled without fullgraph call it eagerly (a graph break)
def delta_chunk_scan_triton(
    u: torch.Tensor,
    w: torch.Tensor,
    q: torch.Tensor,
    a: torch.Tensor,
    k: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tandem.models.layers.gated_deltanet.delta_chunk_scan` as two Triton kernels (same arguments, fp32)."""
    return _DeltaChunkScan.apply(u, w, q, a, k, decay, initial_state)


@triton.jit
def _delta_step(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, fresh_ptr, out_ptr,
    v_heads, k_heads, dk, dv, scale, eps,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    n, h, vb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    kh = h // (v_heads // k_heads)
    ks, vs = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < dk, vs < dv
    k = tl.load(k_ptr + (n * k_heads + kh) * dk + ks, mask=k_mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + (n * k_heads + kh) * dk + ks, mask=k_mask, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k) + eps)
    q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
    v = tl.load(v_ptr + (n * v_heads + h) * dv + vs, mask=v_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + n * v_heads + h).to(tl.float32))
    beta = tl.load(beta_ptr + n * v_heads + h).to(tl.float32)
    slot = tl.load(slots_ptr + n)
    offsets = (slot * v_heads + h) * dk * dv + ks[:, None] * dv + vs[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(states_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    state = tl.where(tl.load(fresh_ptr + n) != 0, 0.0, state) * decay
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(states_ptr + offsets, state.to(states_ptr.dtype.element_ty), mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (n * v_heads + h) * dv + vs, out.to(out_ptr.dtype.element_ty), mask=v_mask)


def gated_delta_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """`tandem.models.layers.gated_deltanet.gated_delta_step` as one kernel: one program per (sequence, value head,
    value block) normalises its q and k, reads its slice of the slot's state once, advances it by the token, writes it
    back in place and stores the output (the torch step reads and writes the whole state about a dozen times)."""
    batch, k_heads, dk = k.shape
    v_heads, dv = v.shape[1:]
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, min(64, triton.next_power_of_2(dv)))
    out = torch.empty_like(v)
    q, k, v, g, beta, slots = (t.contiguous() for t in (q, k, v, g, beta, slots))  # slots: an inputs column
    _delta_step[(batch, v_heads, triton.cdiv(dv, bv))](
        q, k, v, g, beta, states, slots, fresh.contiguous().view(torch.uint8), out,
        v_heads, k_heads, dk, dv, dk**-0.5, 1e-6,
        BK=bk, BV=bv, num_warps=4,
    )  # fmt: skip
    return out
