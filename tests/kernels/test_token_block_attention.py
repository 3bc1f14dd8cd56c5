"""Deterministic extend attention in token blocks (kernels/token_block_attention.py) against decode
attention run for each token alone, bit for bit, under the Triton interpreter (`row_dot`: each output
element its own sum, as on the GPU's tensor cores)."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (
    DecodeTiles,
    alloc_decode_partials,
    decode_attention,
    fixed_size_kv_splits,
)
from kernels.reference import decode_attention_ref
from kernels.token_block_attention import token_block_attention, token_blocks, tokens_per_block
from tests.kernels.conftest import poisoned, rel_error

SPLIT = 16
TILES = DecodeTiles(block_n=16)


def _naive_blocks(lens: list[int], tokens: int, bound: int) -> tuple[list[int], list[int]]:
    first, count, start = [], [], 0
    for n in lens:
        for b in range(0, n, tokens):
            first.append(start + b)
            count.append(min(tokens, n - b))
        start += n
    pad = bound - len(first)
    return first + [0] * pad, count + [0] * pad


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_token_blocks_are_each_segments_runs_then_empty_ones(tokens: int) -> None:
    lens = [0, 5, 8, 1, 0, 17, 9]
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    exact = sum(-(-n // tokens) for n in lens)
    for bound in (exact, exact + 4):
        first, count = token_blocks(qo, bound, tokens)
        assert first.dtype == count.dtype == torch.int32
        assert (first.tolist(), count.tolist()) == _naive_blocks(lens, tokens, bound)


def test_tokens_per_block_fill_decodes_padded_rows() -> None:
    assert tokens_per_block(16, 8) == 8  # Qwen3-0.6B: a group of 2 in 16 rows
    assert tokens_per_block(32, 8) == 4  # Qwen3-8B
    assert tokens_per_block(6, 2) == 5  # a group of 3: 15 of 16 rows
    assert tokens_per_block(64, 2) == 1  # a group of 32 fills its own rows


class _Extend:
    """New tokens of several requests over a paged pool: request i's last new[i] positions (the earlier
    ones its prefix), with per-token rows, key counts and fixed-size splits."""

    def __init__(self, gen, paged_kv, seq_lens, new, num_heads, num_kv_heads, head_dim, dtype) -> None:  # noqa: ANN001
        self.kv = paged_kv(gen, seq_lens, num_kv_heads, head_dim, dtype)
        rows, lens = [], []
        for row, n, k in zip(self.kv.req_pool_indices.tolist(), seq_lens, new):
            rows += [row] * k
            lens += list(range(n - k + 1, n + 1))
        self.new = new
        self.req_rows = torch.tensor(rows, dtype=torch.int64)
        self.seq_lens = torch.tensor(lens, dtype=torch.int64)
        self.splits = fixed_size_kv_splits(self.seq_lens, SPLIT)
        self.max_splits = 1 << max(0, (int(self.splits.max()) - 1).bit_length())
        self.q = torch.randn((len(lens), num_heads * head_dim), generator=gen).to(dtype)
        self.num_heads, self.head_dim = num_heads, head_dim

    def blocks(self, pad_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        qo = torch.tensor([0, *torch.tensor(self.new).cumsum(0).tolist()])
        per = tokens_per_block(self.num_heads, self.kv.k_buffer.shape[1])
        return token_blocks(qo, sum(-(-n // per) for n in self.new) + pad_blocks, per)

    def run(self, blocks: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        out = poisoned(tuple(self.q.shape), self.q.dtype) if out is None else out
        first, count = self.blocks(pad_blocks=2)
        token_block_attention(
            self.q, self.kv.k_buffer, self.kv.v_buffer, out, self.kv.req_to_token, self.req_rows, self.seq_lens,
            self.splits, first, count, self.max_splits, self.head_dim**-0.5, SPLIT, TILES, blocks=blocks,
        )  # fmt: skip
        return out

    def decode_alone(self, t: int) -> torch.Tensor:
        out = poisoned((1, self.q.shape[1]), self.q.dtype)
        part_out, part_lse = alloc_decode_partials(1, self.num_heads, self.max_splits, self.head_dim, "cpu")
        decode_attention(
            self.q[t : t + 1], self.kv.k_buffer, self.kv.v_buffer, out, self.kv.req_to_token,
            self.req_rows[t : t + 1], self.seq_lens[t : t + 1], self.splits[t : t + 1], self.max_splits,
            self.head_dim**-0.5, part_out, part_lse, TILES, split_tokens=SPLIT,
        )  # fmt: skip
        return out[0]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (4, 2, 16, torch.float32),  # a group of 2: 8 tokens a block
        (8, 2, 16, torch.bfloat16),  # a group of 4: 4 tokens a block
        (6, 2, 24, torch.float32),  # a group of 3 (5 tokens in 15 of 16 rows), head_dim off the power of two
    ],
)
def test_each_token_is_its_decode_alone_bit_for_bit(gen, paged_kv, row_dot, num_heads, num_kv_heads, head_dim, dtype) -> None:  # noqa: ANN001
    # Request 0's new tokens span one split then two (positions 12..25: blocks mix 1- and 2-split
    # tokens); request 1 crosses into a third split; request 2 is a single token.
    ext = _Extend(gen, paged_kv, [26, 40, 7], [14, 9, 1], num_heads, num_kv_heads, head_dim, dtype)
    out = ext.run()
    for t in range(ext.q.shape[0]):
        assert torch.equal(out[t], ext.decode_alone(t)), f"token {t} differs from its decode"
    ref = decode_attention_ref(
        ext.q.float(), ext.kv.k_buffer.float(), ext.kv.v_buffer.float(), ext.kv.req_to_token, ext.req_rows,
        ext.seq_lens, head_dim**-0.5,
    )  # fmt: skip
    assert rel_error(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_launches_over_block_ranges_give_one_launchs_bits(gen, paged_kv, row_dot) -> None:  # noqa: ANN001
    ext = _Extend(gen, paged_kv, [33, 20], [21, 6], 4, 2, 16, torch.float32)
    whole = ext.run()
    num_blocks = ext.blocks()[0].shape[0] + 2
    parts = poisoned(tuple(ext.q.shape))
    for first in range(0, num_blocks, 2):
        ext.run(blocks=(first, min(num_blocks, first + 2)), out=parts)
    assert torch.equal(parts, whole)


def test_tokens_with_no_keys_get_zeros(gen, paged_kv) -> None:  # noqa: ANN001
    """A CUDA graph's padding: a last segment of tokens with seq_len 0 (their splits clamp to 1)."""
    ext = _Extend(gen, paged_kv, [20], [5], 4, 2, 16, torch.float32)
    q = torch.cat([ext.q, torch.randn((3, ext.q.shape[1]), generator=gen)])
    req_rows = torch.cat([ext.req_rows, ext.req_rows[-1:].repeat(3)])
    seq_lens = torch.cat([ext.seq_lens, torch.zeros(3, dtype=torch.int64)])
    first, count = token_blocks(torch.tensor([0, 5, 8]), 4, tokens_per_block(4, 2))
    out = poisoned(tuple(q.shape))
    token_block_attention(
        q, ext.kv.k_buffer, ext.kv.v_buffer, out, ext.kv.req_to_token, req_rows, seq_lens,
        fixed_size_kv_splits(seq_lens, SPLIT), first, count, 2, 0.25, SPLIT, TILES,
    )  # fmt: skip
    assert torch.equal(out[5:], torch.zeros(3, q.shape[1]))
    assert torch.isfinite(out[:5]).all()


def test_bad_arguments_are_named(gen, paged_kv) -> None:  # noqa: ANN001
    ext = _Extend(gen, paged_kv, [20], [5], 4, 2, 16, torch.float32)
    first, count = ext.blocks()
    args = (ext.q, ext.kv.k_buffer, ext.kv.v_buffer, torch.empty_like(ext.q), ext.kv.req_to_token, ext.req_rows,
            ext.seq_lens, ext.splits, first, count)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of block_n 16"):
        token_block_attention(*args, 2, 0.25, 24, TILES)
    with pytest.raises(ValueError, match="power of two"):
        token_block_attention(*args, 3, 0.25, SPLIT, TILES)
    with pytest.raises(ValueError, match="out of range"):
        token_block_attention(*args, 2, 0.25, SPLIT, TILES, blocks=(0, 5))
