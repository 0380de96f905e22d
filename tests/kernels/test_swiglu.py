"""The Triton SwiGLU kernels equal torch's `silu(gate) * up` and its autograd, forward and backward.

On CPU they run under Triton's interpreter in fp32; on CUDA compiled, in fp32 and bf16, eagerly and inside
torch.compile(fullgraph=True) (the trainer's compiled blocks).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton SwiGLU kernel needs the triton package (CPU wheels of torch lack it)")

from tandem.kernels.swiglu import silu_mul, swiglu
from tandem.models.layers.mlp import SWIGLU_BACKENDS
from tandem.models.layers.mlp import swiglu as swiglu_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _value_and_grad(fn, gate_up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = gate_up.detach().clone().requires_grad_()
    out = fn(gate_up)
    out.backward(grad)
    return out, gate_up.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 96), (7, 2 * 1500)])  # a ragged last block, more than one block
def test_matches_torch_forward_and_backward(dtype, shape):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    grad = torch.randn((*shape[:-1], shape[-1] // 2), generator=g).to(DEVICE, dtype)
    got, want = _value_and_grad(swiglu, gate_up, grad), _value_and_grad(swiglu_torch, gate_up, grad)
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {}  # bf16: within one rounding
    for ours, reference in zip(got, want, strict=True):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        torch.testing.assert_close(ours, reference, **tolerance)
    torch.testing.assert_close(silu_mul(gate_up), want[0], **tolerance)


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="even last dimension"):
        silu_mul(torch.randn(2, 7, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="compiling around the interpreter is slow and proves nothing")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_fullgraph_matches_eager(dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(64, 2 * 512, generator=g).to(DEVICE, dtype)
    grad = torch.randn(64, 512, generator=g).to(DEVICE, dtype)
    compiled = torch.compile(swiglu, fullgraph=True)
    for got, want in zip(_value_and_grad(compiled, gate_up, grad), _value_and_grad(swiglu, gate_up, grad), strict=True):
        assert torch.equal(got, want)


def test_model_with_triton_swiglu_matches_torch(tiny_model_dir):
    """`swiglu_backend="triton"` (registered by its user, as the trainer does): same loss and gradients."""
    from tandem.models import ModelRuntime, load_model

    SWIGLU_BACKENDS.setdefault("triton", swiglu)
    path = tiny_model_dir("qwen3")
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = []
    for name in ("torch", "triton"):
        model = load_model(path, device=DEVICE, runtime=ModelRuntime(swiglu_backend=name))
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_triton, grads_triton) = results
    torch.testing.assert_close(loss_triton, loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_triton[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_trainer_refuses_triton_kernels_without_gpu(monkeypatch):
    from tandem.config import ConfigError
    from tandem.model_kernels import kernel_options

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"speed.swiglu_kernel = triton: Triton kernels need CUDA"):
        kernel_options(torch.device("cpu"), swiglu="triton")
    with pytest.raises(ConfigError, match=r"speed.index_kernel = triton: Triton kernels need CUDA"):
        kernel_options(torch.device("cpu"), index="triton")
    expected = {
        "rope_backend": "torch",
        "swiglu_backend": "torch",
        "index_backend": "torch",
        "delta_scan_backend": "torch",
        "ssd_backend": "torch",
    }
    assert kernel_options(torch.device("cpu")) == expected
