"""Mamba-2's within-chunk Triton kernels equal the torch einsums (`intra_chunk_ssd`) and their autograd, and the
chunked scan with them equals the token-by-token reference, packed documents included.

On CPU they run under Triton's interpreter; on CUDA compiled. Everything is fp32 (the scan's own precision).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton kernels need the triton package (CPU wheels of torch lack it)")

import torch.nn.functional as F

from support.hybrid_parity import assert_chunked_equals_recurrent, scan_resets, step_kernel_and_torch
from tandem.kernels.ssd import intra_chunk_ssd_triton, ssd_step_triton
from tandem.models.layers.mamba2 import SSD_BACKENDS, SSD_STEP_BACKENDS, chunk_ssd, intra_chunk_ssd, recurrent_ssd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("groups", "heads", "n", "p", "packed"),
    [(1, 2, 16, 16, False), (2, 6, 10, 20, True)],  # aligned; odd sizes, three heads a group, segments
    ids=["aligned", "ragged-grouped-packed"],
)
def test_matches_the_torch_einsums_forward_and_backward(groups, heads, n, p, packed):
    g = torch.Generator().manual_seed(0)
    batch, chunks, size = 2, 3, 16
    C, B = (torch.randn(batch, chunks, size, groups, n, generator=g) for _ in range(2))
    xdt = torch.randn(batch, chunks, size, heads, p, generator=g)
    a = -torch.rand(batch, heads, chunks, size, generator=g)
    seg = None
    if packed:
        resets = F.pad(scan_resets(batch, chunks * size - 1), (1, 0))  # starts at a chunk's first and last token
        seg = resets.unflatten(1, (chunks, size)).long().cumsum(dim=-1)[:, None]
    runs = []
    for intra in (intra_chunk_ssd, intra_chunk_ssd_triton):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (C, B, xdt, a)]
        y = intra(*leaves, None if seg is None else seg.to(DEVICE))
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)).sum().backward()
        runs.append((y, [t.grad for t in leaves]))
    (y, grads), (want, want_grads) = runs[1], runs[0]
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    for name, grad, want_grad in zip(["C", "B", "xdt", "a"], grads, want_grads, strict=True):
        scale = want_grad.abs().max().item()
        torch.testing.assert_close(grad, want_grad, atol=1e-4 * scale, rtol=1e-4, msg=name)


def test_the_chunked_scan_with_the_kernels_equals_the_recurrent_reference():
    """`chunk_ssd(intra="triton")` against `recurrent_ssd`, with resets anywhere and a starting state: outputs,
    final state and every input's gradient (two heads a group, odd head and state sizes)."""
    SSD_BACKENDS.setdefault("triton", intra_chunk_ssd_triton)
    g = torch.Generator().manual_seed(3)
    batch, seq, heads, dim, groups, n = 2, 19, 4, 5, 2, 6
    inputs = [
        torch.randn(batch, seq, heads, dim, generator=g),
        torch.rand(batch, seq, heads, generator=g) * 0.8,
        -torch.rand(heads, generator=g) * 3,
        torch.randn(batch, seq, groups, n, generator=g),
        torch.randn(batch, seq, groups, n, generator=g),
        torch.randn(heads, generator=g),
    ]
    state = torch.randn(batch, heads, dim, n, generator=g)

    def on_device(scan):  # the helper makes its resets on the CPU
        def run(*args, resets, **kwargs):
            return scan(*args, resets=None if resets is None else resets.to(DEVICE), **kwargs)

        return run

    def chunked(*args, **kwargs):
        return chunk_ssd(*args, **kwargs, intra="triton")

    inputs, state = [t.to(DEVICE) for t in inputs], state.to(DEVICE)
    assert_chunked_equals_recurrent(on_device(chunked), on_device(recurrent_ssd), inputs, state, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_kernel_matches_the_torch_step_in_place(dtype):
    """One token for three sequences in slots 4, 0 and 2 of a five-slot cache, the middle one fresh (its slot's stale
    state ignored), x/B/C in the model's dtype: outputs and every slot after the step; slots 1 and 3 untouched."""
    SSD_STEP_BACKENDS.setdefault("triton", ssd_step_triton)
    g = torch.Generator().manual_seed(5)
    n, heads, p, groups, size = 3, 6, 40, 2, 10  # three heads a group, two blocks of head dims
    x = torch.randn(n, heads, p, generator=g).to(dtype)
    dt, A = torch.rand(n, heads, generator=g), -torch.rand(heads, generator=g) * 3
    B, C = (torch.randn(n, groups, size, generator=g).to(dtype) for _ in range(2))
    D = torch.randn(heads, generator=g)
    states = torch.randn(5, heads, p, size, generator=g)
    y, want = step_kernel_and_torch(SSD_STEP_BACKENDS, (x, dt, A, B, C, D), states, DEVICE)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
