"""SiLU-and-mul against the float32 reference (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.reference import silu_and_mul_ref
from tests.kernels.conftest import poisoned, rel_error


@pytest.mark.parametrize(("rows", "d"), [(4, 64), (3, 1500)])  # one block per row; several blocks
def test_silu_and_mul_matches_reference(gen, rows, d) -> None:
    x = torch.randn((rows, 2 * d), generator=gen) * 4
    out = silu_and_mul(x, out=poisoned((rows, d)))
    assert rel_error(out, silu_and_mul_ref(x)) < 1e-5


def test_odd_width_is_rejected(gen) -> None:
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.randn((2, 7), generator=gen))
