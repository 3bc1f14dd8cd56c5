"""The batch-1 Triton GEMV against a float32 matrix product, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvTiles, gemv
from tests.kernels.conftest import poisoned, rel_error


@pytest.mark.parametrize(("n", "k", "tiles"), [
    (48, 64, GemvTiles(16, 32)),      # even K, rows a multiple of the block
    (37, 100, GemvTiles(16, 32)),     # ragged rows and ragged K
    (5, 24, GemvTiles(8, 64)),        # fewer rows than one block, K shorter than one tile
])
def test_gemv_matches_float32_product(gen, n, k, tiles) -> None:
    x = torch.randn((1, k), generator=gen)
    w = torch.randn((n, k), generator=gen)
    out = gemv(x, w, out=poisoned((n,)), tiles=tiles)
    assert out.shape == (1, n)
    assert rel_error(out, x @ w.t()) < 1e-5


def test_gemv_reads_a_row_slice_of_a_wider_weight(gen) -> None:
    # A weight whose rows are strided (a view of a bigger matrix) is read through its row stride.
    big = torch.randn((20, 80), generator=gen)
    w = big[:, 16:48]
    x = torch.randn(32, generator=gen)
    out = gemv(x, w, tiles=GemvTiles(8, 16))
    assert out.shape == (20,)
    assert rel_error(out, w @ x) < 1e-5


def test_gemv_rejects_what_it_cannot_compute(gen) -> None:
    w = torch.randn((8, 16), generator=gen)
    with pytest.raises(ValueError, match="one row of 16"):
        gemv(torch.randn((2, 16), generator=gen), w)
    with pytest.raises(ValueError, match="one row of 16"):
        gemv(torch.randn((1, 15), generator=gen), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.randn((1, 8), generator=gen), w.t())
    with pytest.raises(ValueError, match="bfloat16"):
        gemv(torch.randn((1, 16), generator=gen).bfloat16(), w)
