"""The Triton Gumbel-max draw equals the sampler's torch path: the same tokens (hash, rounding, first index on
ties) and the same logprobs, for greedy and sampled rows, any temperature, a ragged last block and -inf logits.

On CPU it runs under Triton's interpreter; on CUDA compiled, in fp32 and bf16, and through the engine's sampler.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton sampling kernel needs the triton package")

from tandem.inference.sampling import Sampler, SamplingBatch, gumbel_noise, row_keys
from tandem.kernels.gumbel import BLOCK, gumbel_max
from tandem.wire.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _rows(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * rows)[:rows]
    return {
        "temperature": temperature,
        "divisor": torch.where(temperature > 0, temperature, 1.0),
        "seeds": torch.randint(-(2**62), 2**62, (rows,), generator=g),
        "samples": torch.randint(0, 16, (rows,), generator=g),
        "steps": torch.randint(0, 4096, (rows,), generator=g),
    }


def _reference(logits: torch.Tensor, r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: tempered fp32 logits, hashed noise on sampled rows, argmax, log-softmax."""
    z = logits.float() / r["divisor"][:, None]
    ids = torch.arange(z.shape[1], device=z.device)
    noise = gumbel_noise(r["seeds"], r["samples"], r["steps"], ids)
    tokens = torch.where(r["temperature"][:, None] > 0, z + noise, z).argmax(dim=-1)
    return tokens, z.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]


def _ours(logits: torch.Tensor, r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return gumbel_max(logits, r["divisor"], r["temperature"] > 0, *row_keys(r["seeds"], r["samples"], r["steps"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [BLOCK // 2 + 3, 2 * BLOCK + 1000])  # one partial block; several, ragged
def test_matches_the_torch_sampler(dtype, vocab):
    rows = 12
    r = {k: v.to(DEVICE) for k, v in _rows(rows, seed=vocab).items()}
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 4).to(DEVICE, dtype)
    logits[3, ::7] = float("-inf")  # masked-out ids (padded vocabularies) never win and add nothing
    tokens, logprobs = _ours(logits, r)
    want_tokens, want_logprobs = _reference(logits, r)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_lowest_id_and_the_draw_covers_every_block():
    vocab = 3 * BLOCK
    r = {k: v.to(DEVICE) for k, v in _rows(2, seed=0).items()}
    r["temperature"][:] = torch.tensor([0.0, 1.0])
    r["divisor"][:] = 1.0
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [BLOCK + 5, 2 * BLOCK + 7]] = 1.0  # greedy: two equal maxima in different blocks
    tokens, logprobs = _ours(logits, r)
    assert tokens[0].item() == BLOCK + 5
    assert tokens[1].item() == _reference(logits, r)[0][1].item()
    torch.testing.assert_close(logprobs, _reference(logits, r)[1], atol=1e-6, rtol=1e-6)
    # Sampled rows of a flat distribution land in every block over many draws.
    many = {k: v[1:].repeat(60) for k, v in r.items()}
    many["steps"] = torch.arange(60, device=DEVICE)
    drawn, _ = _ours(torch.zeros(60, vocab, device=DEVICE), many)
    assert set((drawn // BLOCK).tolist()) == {0, 1, 2}


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's sampler uses the kernel on CUDA logits only")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sampler_draws_the_same_tokens_with_and_without_the_kernel(dtype):
    params = [SamplingParams(temperature=t, max_tokens=4) for t in (0.0, 1.0, 0.6, 1.0)] * 64
    vocab = 151_936
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(2)) * 3).to(DEVICE, dtype)
    batch = SamplingBatch.build(params, list(range(len(params))), [0] * len(params), [5] * len(params), DEVICE)
    fused, plain = Sampler(triton=True), Sampler(triton=False)
    assert torch.equal(fused.on_device(logits, batch)[0], plain.on_device(logits, batch)[0])
    a, b = fused(logits, batch), plain(logits, batch)
    assert a.tokens == b.tokens
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
