"""Split-K decode attention against the float32 reference, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (
    MAX_KV_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    DecodeTiles,
    alloc_decode_partials,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from kernels.reference import decode_attention_ref
from tests.kernels.conftest import poisoned, rel_error


def _run(kv, q: torch.Tensor, num_heads: int, max_splits: int, sm_scale: float) -> torch.Tensor:
    bs, head_dim = q.shape[0], kv.k_buffer.shape[2]
    splits = kv_splits_per_request(kv.seq_lens, max_splits)
    part_out, part_lse = alloc_decode_partials(bs, num_heads, max_splits, head_dim, "cpu")
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    out = poisoned((bs, num_heads * head_dim))
    decode_attention(
        q, kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        splits, max_splits, sm_scale, part_out, part_lse, DecodeTiles(block_n=16),
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "seq_lens"),
    [
        (4, 4, 32, [1, 37, 300, 530]),  # MHA; lengths of one token, one split, several splits
        (8, 2, 16, [600, 5, 257, 64]),  # GQA 4: one program covers four query heads
        (6, 2, 24, [90, 700]),  # head_dim not a power of two, group of 3 padded to 16 rows
    ],
)
def test_decode_matches_reference(gen, paged_kv, num_heads, num_kv_heads, head_dim, seq_lens) -> None:
    kv = paged_kv(gen, seq_lens, num_kv_heads, head_dim)
    q = torch.randn((len(seq_lens), num_heads * head_dim), generator=gen)
    scale = head_dim**-0.5
    out = _run(kv, q, num_heads, max_splits=4, sm_scale=scale)
    ref = decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, scale
    )
    assert rel_error(out, ref) < 1e-3


def test_decode_result_does_not_depend_on_split_count(gen, paged_kv) -> None:
    kv = paged_kv(gen, [1000, 3], num_kv_heads=2, head_dim=16)
    q = torch.randn((2, 4 * 16), generator=gen)
    one = _run(kv, q, 4, max_splits=1, sm_scale=0.3)
    many = _run(kv, q, 4, max_splits=8, sm_scale=0.3)
    assert rel_error(many, one) < 1e-5


def test_decode_reads_only_the_first_seq_len_positions(gen, paged_kv) -> None:
    kv = paged_kv(gen, [50, 80], num_kv_heads=1, head_dim=16)
    q = torch.randn((2, 16), generator=gen)
    before = _run(kv, q, 1, max_splits=2, sm_scale=0.25)
    # Slots past each request's length (and the padding slot 0) hold garbage the kernel must not read.
    table = kv.req_to_token
    for row, n in zip(kv.req_pool_indices.tolist(), kv.seq_lens.tolist()):
        table[row, n:] = 0
    kv.k_buffer[0] = float("nan")
    kv.v_buffer[0] = float("nan")
    after = _run(kv, q, 1, max_splits=2, sm_scale=0.25)
    assert torch.equal(before, after)


def test_padded_request_of_length_zero_yields_zeros(gen, paged_kv) -> None:
    kv = paged_kv(gen, [40, 1], num_kv_heads=2, head_dim=16)
    kv.seq_lens[1] = 0  # a CUDA-graph padding row
    q = torch.randn((2, 2 * 16), generator=gen)
    out = _run(kv, q, 2, max_splits=2, sm_scale=0.25)
    assert torch.equal(out[1], torch.zeros(2 * 16))
    assert torch.isfinite(out[0]).all()


def test_split_grid_bound_is_a_power_of_two_that_shrinks_with_batch() -> None:
    bounds = [max_kv_splits_for(bs, num_kv_heads=8, num_sms=132) for bs in (1, 2, 8, 64, 512)]
    assert all(b & (b - 1) == 0 and 1 <= b <= MAX_KV_SPLITS for b in bounds)
    assert bounds == sorted(bounds, reverse=True)
    assert bounds[0] * 1 * 8 >= 132  # a single request alone still fills every SM
    with pytest.raises(ValueError, match="batch_size"):
        max_kv_splits_for(0, 8, 132)


def test_splits_per_request_follow_length_within_bound() -> None:
    seq_lens = torch.tensor([1, MIN_TOKENS_PER_SPLIT, MIN_TOKENS_PER_SPLIT + 1, 100 * MIN_TOKENS_PER_SPLIT])
    assert kv_splits_per_request(seq_lens, 8).tolist() == [1, 1, 2, 8]
