"""The Triton RoPE kernel equals the torch rotation bit for bit, forward and backward.

On CPU it runs under Triton's interpreter (fp32 only: the interpreter emulates bf16 rounding differently
from the GPU); on CUDA it runs compiled, in fp32 and bf16, eagerly and inside torch.compile(fullgraph=True).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton RoPE kernel needs the triton package (CPU wheels of torch lack it)")

from tandem.kernels.rope import apply_rope_triton
from tandem.models.layers.rope import apply_rope, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _inputs(dtype: torch.dtype, batch=2, seq=7, heads=8, kv_heads=2, dim=64, seed=0):
    """q and k as the strided views a fused qkv projection gives; cos/sin for random large positions."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    q = qkv[..., : heads * dim].unflatten(-1, (heads, dim))
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
    positions = torch.randint(0, 40_000, (batch, seq), generator=g).to(DEVICE)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEVICE) / dim))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE, dtype) for t in (q, k)]
    return q, k, cos, sin, grads


def _run(fn, q, k, cos, sin, grads):
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    out_q, out_k = fn(q, k, cos, sin)
    torch.autograd.backward([out_q, out_k], grads)
    return out_q.detach(), out_k.detach(), q.grad, k.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_torch_rope_bit_for_bit(dtype, seed):
    inputs = _inputs(dtype, seed=seed)
    for got, want in zip(_run(apply_rope_triton, *inputs), _run(apply_rope, *inputs), strict=True):
        assert torch.equal(got, want)


def test_contiguous_heads_and_broadcast_batch():
    """qk-normed (contiguous) q and k, cos/sin shared by the batch `[1, S, D]`, odd head counts."""
    q, k, cos, sin, grads = _inputs(torch.float32, batch=3, heads=5, kv_heads=3, dim=32)
    q, k = q.contiguous(), k.contiguous()
    cos, sin = cos[:1], sin[:1]
    triton_out, torch_out = _run(apply_rope_triton, q, k, cos, sin, grads), _run(apply_rope, q, k, cos, sin, grads)
    for got, want in zip(triton_out, torch_out, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiling around the interpreter is slow and proves nothing")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_fullgraph_matches_eager_torch(dtype):
    """Compiled, the op stays opaque: a compiled trainer rotates exactly like the eager inference path."""
    inputs = _inputs(dtype)
    compiled = torch.compile(apply_rope_triton, fullgraph=True)
    for got, want in zip(_run(compiled, *inputs), _run(apply_rope, *inputs), strict=True):
        assert torch.equal(got, want)


def test_model_with_triton_rope_matches_torch_rope(tiny_model_dir):
    """`rope_backend="triton"` (registered by its user, as the trainer does) gives the same logits bit for bit."""
    from tandem.models import ModelRuntime, load_model
    from tandem.models.layers.rope import ROPE_BACKENDS

    ROPE_BACKENDS.setdefault("triton", apply_rope_triton)
    path = tiny_model_dir("qwen3")
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = [
        load_model(path, device=DEVICE, runtime=ModelRuntime(rope_backend=name))(ids) for name in ("torch", "triton")
    ]
    assert torch.equal(*logits)
