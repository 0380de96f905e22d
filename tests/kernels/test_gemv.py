"""The Triton GEMV equals `F.linear` for every row count it takes and every tile shape the benchmark sweeps.

On CPU it runs under Triton's interpreter (fp32; tests/conftest.py sets TRITON_INTERPRET); on CUDA compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the GEMV kernel needs the triton package")

from tandem.kernels.gemv import MAX_ROWS, TILES, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tile", TILES, ids=["x".join(map(str, t)) for t in TILES])
def test_gemv_equals_linear(tile):
    """Sizes that are no multiple of any tile, with and without bias, 1 to MAX_ROWS rows."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 300, generator=g).to(DEVICE), torch.randn(70, generator=g).to(DEVICE)
    for rows in (1, 3, MAX_ROWS):
        x = torch.randn(rows, 300, generator=g).to(DEVICE)
        torch.testing.assert_close(gemv(x, weight, tile=tile), F.linear(x, weight), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(gemv(x, weight, bias, tile=tile), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_gemv_refuses_what_it_does_not_take():
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_ROWS + 1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(16, 2, device=DEVICE).T, weight)
