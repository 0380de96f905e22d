"""The Triton pass over chunks of the gated delta rule equals the plain-torch loop (`delta_chunk_scan`) and its
autograd, forward and backward, and so does the whole chunked rule with it, packed documents included.

On CPU it runs under Triton's interpreter; on CUDA compiled. Everything is fp32 (the rule's own precision).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton scan needs the triton package (CPU wheels of torch lack it)")

from support.hybrid_parity import scan_resets, step_kernel_and_torch
from tandem.kernels.delta_scan import delta_chunk_scan_triton, gated_delta_step_triton
from tandem.models.layers.gated_deltanet import SCAN_BACKENDS, STEP_BACKENDS, chunk_gated_delta_rule, delta_chunk_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch: int, heads: int, chunks: int, size: int, dk: int, dv: int, initial: bool) -> list:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    a = rand(batch, heads, chunks, size, size).tril()
    decay = torch.rand(batch, heads, chunks, generator=g).to(DEVICE) * 0.9 + 0.05
    state = rand(batch, heads, dk, dv) if initial else None
    kd = [rand(batch, heads, chunks, size, dk) for _ in range(3)]  # w, q, k
    return [rand(batch, heads, chunks, size, dv), kd[0], kd[1], a, kd[2], decay, state]


@pytest.mark.parametrize(
    ("dk", "dv", "initial"),
    [(16, 16, False), (10, 40, True)],  # one value block; odd sizes over two value blocks, from a state
    ids=["aligned", "ragged-from-state"],
)
def test_matches_the_torch_loop_forward_and_backward(dk, dv, initial):
    inputs = _inputs(2, 3, 4, 16, dk, dv, initial)
    runs = []
    for scan in (delta_chunk_scan, delta_chunk_scan_triton):
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
        out, final = scan(*leaves)
        g = torch.Generator().manual_seed(1)
        weights = torch.randn(out.shape, generator=g).to(DEVICE), torch.randn(final.shape, generator=g).to(DEVICE)
        ((out * weights[0]).sum() + (final * weights[1]).sum()).backward()
        runs.append((out, final, [t.grad if t is not None else None for t in leaves]))
    (out, final, grads), (want_out, want_final, want_grads) = runs[1], runs[0]
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)
    names = ["u", "w", "q", "a", "k", "decay", "initial_state"]
    for name, grad, want in zip(names, grads, want_grads, strict=True):
        if want is None:
            assert grad is None, name
            continue
        if name == "a":  # only the lower triangle reaches the outputs (the rule masks the rest to zero)
            grad, want = grad.tril(), want.tril()
        torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4, msg=name)


def test_the_chunked_rule_with_the_kernel_matches_the_loop_on_packed_documents():
    """`chunk_gated_delta_rule(scan="triton")` against the loop, with resets anywhere (documents straddling chunk
    edges) and a starting state: outputs, final state and the gradients of q, k, v, g, beta."""
    SCAN_BACKENDS.setdefault("triton", delta_chunk_scan_triton)
    g = torch.Generator().manual_seed(2)
    batch, seq, hk, hv, dk, dv = 2, 19, 2, 4, 12, 20
    q, k = (torch.randn(batch, seq, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(batch, seq, hv, dv, generator=g)
    gate, beta = -torch.rand(batch, seq, hv, generator=g), torch.rand(batch, seq, hv, generator=g)
    state = torch.randn(batch, hv, dk, dv, generator=g) * 0.1
    resets = scan_resets(batch, seq)
    runs = []
    for scan in ("torch", "triton"):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (q, k, v, gate, beta)]
        out, final = chunk_gated_delta_rule(*leaves, resets.to(DEVICE), state.to(DEVICE), chunk_size=16, scan=scan)
        (out.square().sum() + final.sum()).backward()
        runs.append((out, final, [t.grad for t in leaves]))
    for got, want in zip(runs[1][:2], runs[0][:2], strict=True):  # fp32 sums in another order
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for name, got, want in zip("q k v g beta".split(), runs[1][2], runs[0][2], strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_kernel_matches_the_torch_step_in_place(dtype):
    """One token for three sequences in slots 4, 0 and 2 of a five-slot cache, the middle one fresh (its slot's stale
    state ignored), q/k/v in the model's dtype: outputs and every slot after the step; slots 1 and 3 untouched."""
    STEP_BACKENDS.setdefault("triton", gated_delta_step_triton)
    g = torch.Generator().manual_seed(4)
    n, hk, hv, dk, dv = 3, 2, 4, 12, 20
    q, k = (torch.randn(n, hk, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(n, hv, dv, generator=g).to(dtype)
    gate, beta = -torch.rand(n, hv, generator=g), torch.rand(n, hv, generator=g).to(dtype)
    states = torch.randn(5, hv, dk, dv, generator=g)
    out, want = step_kernel_and_torch(STEP_BACKENDS, (q, k, v, gate, beta), states, DEVICE)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(out, want, atol=tolerance, rtol=tolerance)
