"""Constrained decoding's mask in one launch: for each constrained row, every token whose bit is clear
in that row's llguidance bitmask becomes -inf in the logits, in place.

Bit j of int32 word w of a row's bitmask is token 32*w + j (llguidance's layout). The torch form
(services/worker/runtime/sampling/grammar.py `unpack_bitmask`) expands the bitmask to a [rows, V] bool tensor
in five elementwise passes and then gathers, masks and scatters the rows; here each program loads one
tile of one row's logits' words, and writes -inf where the bit is clear: no [rows, V] temporaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _apply_token_bitmask(Logits, stride_row, Rows, Bitmask, words, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    row = tl.load(Rows + r)
    tokens = tile * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    word = tl.load(Bitmask + r * words + tokens // 32, mask=inside, other=-1)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(Logits + row * stride_row + tokens, float("-inf"), mask=inside & (~allowed))


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [bs, V] float32 (rows contiguous); rows [n] int64, the logits row of each bitmask row;
    bitmask [n, ceil(V / 32)] int32, on the logits' device. Disallowed tokens become -inf, in place."""
    n, words = bitmask.shape
    vocab = logits.shape[1]
    if n == 0:
        return
    assert logits.stride(1) == 1 and words * 32 >= vocab
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask[grid](logits, logits.stride(0), rows, bitmask, words, vocab, BLOCK=BLOCK)
