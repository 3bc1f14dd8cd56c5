"""kernels/interpreter_compat.py's casts: the interpreter stores the bits a GPU stores (round to nearest
even), checked against torch's own casts."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask).to(Y.dtype.element_ty), mask=mask)


def _awkward_values(dtype: torch.dtype) -> torch.Tensor:
    """Values either side of bfloat16's halfway points, exact ties (odd and even), and random ones."""
    one = torch.tensor(
        [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-12, 1.0 + 2.0**-9, -1.0 - 2.0**-8]
    )
    rand = torch.randn(200, generator=torch.Generator().manual_seed(3)) * 100
    return torch.cat([one, one * 2.0**-20, rand, torch.tensor([0.0, -0.0, 65504.0])]).to(dtype)


@pytest.mark.parametrize(("src", "dst"), [
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float64, torch.bfloat16),
])  # fmt: skip
def test_bfloat16_casts_round_to_nearest_even_as_torch(src, dst) -> None:
    x = _awkward_values(src)
    y = torch.empty(x.shape, dtype=dst)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(dst)
    assert torch.equal(y.view(torch.int16 if dst != torch.float32 else torch.int32),
                       want.view(torch.int16 if dst != torch.float32 else torch.int32))  # fmt: skip


@triton.jit
def _dot_kernel(A, B, C, CAST_B: tl.constexpr):
    r = tl.arange(0, 16)
    a = tl.load(A + r[:, None] * 16 + r[None, :])
    b = tl.load(B + r[:, None] * 16 + r[None, :])
    if CAST_B:
        b = b.to(a.dtype)
    tl.store(C + r[:, None] * 16 + r[None, :], tl.dot(a, b))


@pytest.mark.parametrize("b_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_bfloat16_dots_multiply_values_not_bits(b_dtype) -> None:
    # Unpatched, Triton 3.6's interpreter multiplies bfloat16 operands' uint16 bit patterns as integers
    # (here ~1e10 off); an e4m3 tile converted to bfloat16 in the kernel is the weight-side case.
    gen = torch.Generator().manual_seed(5)
    a = torch.randn((16, 16), generator=gen).bfloat16()
    b = torch.randn((16, 16), generator=gen).to(b_dtype)
    c = torch.empty((16, 16))
    _dot_kernel[(1,)](a, b, c, CAST_B=b_dtype != torch.bfloat16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)
