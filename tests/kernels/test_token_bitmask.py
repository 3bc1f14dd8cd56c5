"""The constrained-decoding mask kernel (kernels/token_bitmask.py) against the torch form it replaces
on CUDA (grammar.unpack_bitmask + masked_fill), under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import BLOCK, apply_token_bitmask_
from services.worker.runtime.sampling.grammar import unpack_bitmask


@pytest.mark.parametrize(("bs", "vocab", "rows"), [(4, 300, [0, 2, 3]), (3, BLOCK + 33, [1]), (2, 64, [0, 1])])
def test_kernel_masks_exactly_the_cleared_bits_of_its_rows(bs: int, vocab: int, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(bs * vocab)
    padded = torch.randn(bs, vocab + 7, generator=gen)
    logits = padded[:, :vocab]  # the sampler's view of a wider logits buffer: rows are strided
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
    index = torch.tensor(rows, dtype=torch.int64)
    expected = logits.clone()
    expected[index] = expected[index].masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    apply_token_bitmask_(logits, index, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[index]).any() and not torch.isinf(padded[:, vocab:]).any()
    others = [r for r in range(bs) if r not in rows]
    assert not torch.isinf(logits[others]).any()


def test_unpack_reads_bit_j_of_word_w_as_token_32w_plus_j() -> None:
    bitmask = torch.tensor([[1 | -(2**31), 0b100]], dtype=torch.int32)  # bit 31 is the sign bit
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (1, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 34]
