"""Extend attention (cached prefix + causal new tokens, many requests per launch) against the float32
reference, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (
    DecodeTiles,
    alloc_decode_partials,
    decode_attention,
    kv_splits_per_request,
)
from kernels.extend_attention import (
    TABLE_ROWS,
    ExtendTiles,
    alloc_extend_partials,
    extend_attention,
    extend_block_table,
)
from kernels.reference import extend_attention_ref
from tests.kernels.conftest import poisoned, rel_error


def _qkv_views(gen: torch.Generator, tokens: int, heads: int, kv_heads: int, head_dim: int):
    """q, k, v as column slices of one fused projection output, the way a model hands them over."""
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=gen)
    return qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)


SMALL = ExtendTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _run(
    kv, q, k, v, prefix_lens: list[int], extend_lens: list[int], scale: float, tiles=SMALL, num_blocks=None,
    table=None, partials=None,
):  # fmt: skip
    out = poisoned(q.shape)
    indptr = torch.tensor([0, *extend_lens]).cumsum(0).to(torch.int32)
    if table is None:
        table = extend_block_table(prefix_lens, extend_lens, tiles.block_m, num_blocks)
    extend_attention(
        q, k, v, out, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices,
        torch.tensor(prefix_lens, dtype=torch.int32), indptr, table, scale, tiles, partials,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "prefix_lens", "extend_lens"),
    [
        (4, 4, 32, [0, 0, 0], [1, 40, 17]),  # plain prefill, MHA
        (8, 2, 16, [0, 0], [33, 5]),  # plain prefill, GQA 4
        (4, 4, 16, [21, 0, 64], [19, 50, 1]),  # cached prefixes (chunked prefill / radix hit), MHA
        (8, 2, 32, [37, 5, 0], [30, 48, 9]),  # cached prefixes, GQA 4
        (6, 2, 24, [13], [22]),  # head_dim not a power of two
    ],
)
def test_extend_matches_reference(
    gen, paged_kv, num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens
) -> None:
    # The pool holds every position; the new tokens' own K/V come from the k/v arguments.
    kv = paged_kv(gen, [p + e for p, e in zip(prefix_lens, extend_lens)], num_kv_heads, head_dim)
    q, k, v = _qkv_views(gen, sum(extend_lens), num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = _run(kv, q, k, v, prefix_lens, extend_lens, scale)
    ref = _ref(kv, q, k, v, prefix_lens, extend_lens, scale)
    assert rel_error(out, ref) < 1e-3


@pytest.mark.parametrize("tiles", [ExtendTiles(), ExtendTiles(block_m=32, block_n=16, num_warps=4)])
def test_extend_other_tile_shapes_match_reference(gen, paged_kv, tiles) -> None:
    # The GPU default, and query blocks spanning several key tiles.
    prefix_lens, extend_lens = [70, 0], [130, 3]
    kv = paged_kv(gen, [p + e for p, e in zip(prefix_lens, extend_lens)], 2, 16)
    q, k, v = _qkv_views(gen, sum(extend_lens), 4, 2, 16)
    out = _run(kv, q, k, v, prefix_lens, extend_lens, 0.25, tiles)
    ref = _ref(kv, q, k, v, prefix_lens, extend_lens, 0.25)
    assert rel_error(out, ref) < 1e-3


def test_one_new_token_after_a_prefix_equals_decode(gen, paged_kv) -> None:
    prefix_lens = [45, 300]
    kv = paged_kv(gen, [p + 1 for p in prefix_lens], 2, 16)
    q, k, v = _qkv_views(gen, 2, 8, 2, 16)
    # Decode reads the new token from the pool, so put it there first.
    for i, (row, p) in enumerate(zip(kv.req_pool_indices.tolist(), prefix_lens)):
        slot = int(kv.req_to_token[row, p])
        kv.k_buffer[slot] = k[i].view(2, 16)
        kv.v_buffer[slot] = v[i].view(2, 16)
    extended = _run(kv, q, k, v, prefix_lens, [1, 1], 0.25)
    part_out, part_lse = alloc_decode_partials(2, 8, 4, 16, "cpu")
    decoded = poisoned((2, 8 * 16))
    splits = kv_splits_per_request(kv.seq_lens, 4)
    decode_attention(
        q, kv.k_buffer, kv.v_buffer, decoded, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        splits, 4, 0.25, part_out, part_lse, DecodeTiles(block_n=16),
    )  # fmt: skip
    assert rel_error(extended, decoded) < 1e-5


def test_extend_rejects_mismatched_indptr(gen, paged_kv) -> None:
    kv = paged_kv(gen, [4], 1, 16)
    q, k, v = _qkv_views(gen, 4, 1, 1, 16)
    with pytest.raises(ValueError, match="qo_indptr"):
        extend_attention(
            q, k, v, poisoned(q.shape), kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices,
            torch.tensor([0], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32),
            extend_block_table([0], [4], SMALL.block_m), 0.25, SMALL,
        )  # fmt: skip


def test_extend_rejects_block_m_not_a_multiple_of_block_n(gen, paged_kv) -> None:
    kv = paged_kv(gen, [4], 1, 16)
    q, k, v = _qkv_views(gen, 4, 1, 1, 16)
    with pytest.raises(ValueError, match="block_m"):
        _run(kv, q, k, v, [0], [4], 0.25, ExtendTiles(block_m=48, block_n=32))


def test_block_table_lists_every_block_heaviest_first_and_pads() -> None:
    # Keys visited: request 0's blocks 20 + 16 and 20 + 17, request 1's 5 + 16 and 5 + 32 (a tie with
    # request 0's second block, kept in batch order); request 2 has no new tokens, so no block.
    table = extend_block_table([20, 5, 9], [17, 32, 0], block_m=16, num_blocks=7)
    assert table.dtype == torch.int32
    assert table.tolist() == [
        [0, 1, 0, 1, -1, -1, -1],
        [16, 16, 0, 0, 0, 0, 0],
        [0] * 7,  # split index
        [1] * 7,  # splits of the block: none is split without num_sms
        [-1] * 7,  # scratch slot
    ]
    with pytest.raises(ValueError, match="num_blocks"):
        extend_block_table([0], [40], block_m=16, num_blocks=2)


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "num_blocks"),
    [
        ([5, 0], [20, 3], 9),  # a table longer than the batch needs (a CUDA graph's bound)
        ([11, 0, 0, 7], [18, 0, 0, 2], 6),  # requests with no new tokens (a graph's padded requests)
    ],
)
def test_extend_with_a_padded_block_table_matches_reference(
    gen, paged_kv, prefix_lens, extend_lens, num_blocks
) -> None:
    kv = paged_kv(gen, [max(p + e, 1) for p, e in zip(prefix_lens, extend_lens)], 2, 16)
    real = sum(extend_lens)
    # Rows past the requests' tokens stand for a graph's padded tokens: no request owns them.
    q, k, v = _qkv_views(gen, real + 5, 4, 2, 16)
    out = _run(kv, q, k, v, prefix_lens, extend_lens, 0.25, num_blocks=num_blocks)
    # The reference over the requests that have new tokens (the others own no rows).
    some = [i for i, n in enumerate(extend_lens) if n]
    ref = extend_attention_ref(
        q[:real],
        k[:real],
        v[:real],
        kv.k_buffer,
        kv.v_buffer,
        kv.req_to_token,
        kv.req_pool_indices[some],
        [prefix_lens[i] for i in some],
        [extend_lens[i] for i in some],
        0.25,
    )
    assert rel_error(out[:real], ref) < 1e-3
    # The padded rows were left alone (still the poison).
    assert out[real:].isnan().all()


def _ref(kv, q, k, v, prefix_lens, extend_lens, scale):
    return extend_attention_ref(
        q, k, v, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, prefix_lens, extend_lens, scale
    )


def test_split_table_splits_the_heaviest_block_until_it_is_no_heavier_than_a_lanes_share() -> None:
    # Blocks (keys visited): request 0 one (400 prefix + 10), request 1 two (100 + 16, 100 + 20),
    # request 2 one (5). 2 heads on 8 SMs: 8 lanes, a share of 651 / 8 = 81.4 keys.
    table = extend_block_table(
        [400, 100, 0], [10, 20, 5], block_m=16, num_heads=2, num_sms=8, max_split_slots=8, min_keys_per_split=64
    )
    assert table.shape[0] == TABLE_ROWS
    entries = table.T.tolist()
    # Request 0 splits while a part outweighs the share: 400/5 + 10 = 90 > 81.4, so 6 parts of 66-67
    # keys (>= 64); request 1's prefix cannot make parts of 64 keys, so its blocks stay whole.
    assert len(entries) == 9
    parts = sorted((e for e in entries if e[0] == 0), key=lambda e: e[2])
    assert [e[2] for e in parts] == [0, 1, 2, 3, 4, 5] and {e[3] for e in parts} == {6}
    assert sorted(e[4] for e in parts) == [0, 1, 2, 3, 4, 5]  # one scratch slot per part, a group's in a row
    assert all(e[3] == 1 and e[4] == -1 for e in entries if e[0] != 0)
    # Heaviest first: request 1's blocks (120, 116 keys), then request 0's last part (66.7 + 10).
    assert [e[:3] for e in entries[:3]] == [[1, 16, 0], [1, 0, 0], [0, 0, 5]]


def test_a_long_chunk_beside_many_light_blocks_is_split() -> None:
    """A mixed step: 32 one-token decodes (short contexts) and one chunk after a long prefix. There are
    more entries than lanes, yet the chunk's block alone would take longer than all the rest."""
    prefixes, news = [100] * 32 + [3000], [1] * 32 + [128]
    table = extend_block_table(prefixes, news, block_m=128, num_heads=16, num_sms=132, max_split_slots=64,
                               min_keys_per_split=128)  # fmt: skip
    chunk = [e for e in table.T.tolist() if e[0] == 32]
    share = (32 * 101 + 3000 + 128) / (2 * 132 // 16)
    n = len(chunk)
    assert n > 1 and chunk[0][3] == n
    assert 3000 / n + 128 <= share or 3000 // (n + 1) < 128  # no heavier than a share, or parts at the floor
    assert 3000 / (n - 1) + 128 > share  # and not split further than that
def test_split_table_respects_slots_and_capacity() -> None:
    kw = dict(num_heads=1, num_sms=64, min_keys_per_split=16)
    few_slots = extend_block_table([1000], [4], block_m=16, max_split_slots=3, **kw)
    assert few_slots[3].tolist() == [3, 3, 3]  # 3 slots: 3 parts
    full = extend_block_table([1000], [4], block_m=16, num_blocks=4, max_split_slots=64, **kw)
    assert full.shape[1] == 4 and full[3].tolist() == [4, 4, 4, 4]  # a graph's table: no entry past it
    no_slots = extend_block_table([1000], [4], block_m=16, max_split_slots=0, **kw)
    assert no_slots[3].tolist() == [1]


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "heads", "kv_heads"),
    [
        ([300], [5], 4, 2),  # a mixed step's short chunk after a long prefix
        ([250, 0, 97], [40, 3, 17], 8, 2),  # several blocks, one of them split; GQA 4
        ([200, 130], [1, 1], 4, 4),  # decode-like rows; both requests split
    ],
)
def test_split_prefixes_match_reference_and_leave_counters_zero(
    gen, paged_kv, prefix_lens, extend_lens, heads, kv_heads
) -> None:
    kv = paged_kv(gen, [p + e for p, e in zip(prefix_lens, extend_lens)], kv_heads, 16)
    q, k, v = _qkv_views(gen, sum(extend_lens), heads, kv_heads, 16)
    table = extend_block_table(
        prefix_lens, extend_lens, SMALL.block_m, num_heads=heads, num_sms=64, max_split_slots=12,
        min_keys_per_split=32,
    )  # fmt: skip
    assert (table[3] > 1).any()  # the case really splits
    partials = alloc_extend_partials(12, heads, SMALL.block_m, 16, "cpu")
    partials[0].fill_(float("nan"))
    out = _run(kv, q, k, v, prefix_lens, extend_lens, 0.25, table=table, partials=partials)
    assert rel_error(out, _ref(kv, q, k, v, prefix_lens, extend_lens, 0.25)) < 1e-3
    assert partials[2].eq(0).all()
    # The same table again (a CUDA graph's replay): the counters were left ready.
    again = _run(kv, q, k, v, prefix_lens, extend_lens, 0.25, table=table, partials=partials)
    assert torch.equal(out, again)


def test_partials_of_the_wrong_shape_are_refused(gen, paged_kv) -> None:
    kv = paged_kv(gen, [40], 2, 16)
    q, k, v = _qkv_views(gen, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="partials"):
        _run(kv, q, k, v, [36], [4], 0.25, partials=alloc_extend_partials(4, 4, 32, 16, "cpu"))
