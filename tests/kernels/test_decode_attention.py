"""Split-K decode attention against the float32 reference, under the Triton interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from kernels.decode_attention import (
    MAX_KV_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    NARROW_BATCH_TILES,
    SINGLE_REQUEST_TILES,
    SINGLE_REQUEST_WARPS_ENV,
    WIDE_BATCH,
    WIDE_BATCH_TILES,
    DecodeTiles,
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    fixed_size_kv_splits,
    kv_splits_per_request,
    max_kv_splits_for,
    tiles_for,
)
from kernels.reference import decode_attention_ref
from tests.kernels.conftest import poisoned, rel_error

# Few tokens per split, so short test sequences still use many splits (up to MAX_KV_SPLITS).
TOKENS_PER_SPLIT = 16


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter stores bfloat16 as uint16 and `tl.dot` multiplies those bit patterns
    (triton-lang/triton#11584; bfloat16 is unsupported there). Widen the operands to float32 first, which
    is what the tensor cores compute: exact products of bfloat16 values, summed in float32."""
    original = interpreter.InterpreterBuilder.create_dot

    def widen(x: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


class Scratch:
    """Poisoned scratch and fresh counters for one call, kept so tests can look at them afterwards."""

    def __init__(self, bs: int, num_heads: int, num_kv_heads: int, max_splits: int, head_dim: int) -> None:
        self.part_out, self.part_lse = alloc_decode_partials(bs, num_heads, max_splits, head_dim, "cpu")
        self.part_out.fill_(float("nan"))
        self.part_lse.fill_(float("nan"))
        self.counters = alloc_split_counters(bs, num_kv_heads, "cpu")


def _run(
    kv,
    q: torch.Tensor,
    num_heads: int,
    max_splits: int,
    sm_scale: float,
    tokens_per_split: int = TOKENS_PER_SPLIT,
    scratch: Scratch | None = None,
    splits: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
    grid_splits: int = 0,
) -> torch.Tensor:
    bs, num_kv_heads, head_dim = q.shape[0], kv.k_buffer.shape[1], kv.k_buffer.shape[2]
    if splits is None:
        splits = kv_splits_per_request(kv.seq_lens, max_splits, min_tokens_per_split=tokens_per_split)
    scratch = scratch or Scratch(bs, num_heads, num_kv_heads, max_splits, head_dim)
    out = poisoned((bs, num_heads * head_dim), q.dtype)
    decode_attention(
        q, kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        splits, max_splits, sm_scale, scratch.part_out, scratch.part_lse, tiles or DecodeTiles(block_n=16),
        scratch.counters, grid_splits=grid_splits,
    )  # fmt: skip
    return out


def _ref(kv, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
    return decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, sm_scale
    )


@pytest.mark.parametrize("max_splits", [1, 4, MAX_KV_SPLITS])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "seq_lens"),
    [
        (4, 4, 32, [1, 37, 300, 530]),  # MHA; lengths of one token, one split, several splits
        (8, 2, 16, [1100, 5, 257, 64]),  # GQA 4: four query heads per program; 1100 tokens reach 64 splits
        (6, 2, 24, [90, 700]),  # head_dim not a power of two, group of 3 padded to 16 rows
    ],
)
def test_decode_matches_reference(
    gen, paged_kv, num_heads, num_kv_heads, head_dim, seq_lens, max_splits
) -> None:
    kv = paged_kv(gen, seq_lens, num_kv_heads, head_dim)
    q = torch.randn((len(seq_lens), num_heads * head_dim), generator=gen)
    scale = head_dim**-0.5
    out = _run(kv, q, num_heads, max_splits, scale)
    assert rel_error(out, _ref(kv, q, scale)) < 1e-3


@pytest.mark.parametrize("max_splits", [1, 8])
@pytest.mark.parametrize(("head_major", "k_rows"), [(False, False), (True, False), (False, True)])
def test_decode_grid_order_and_k_layout_match_reference(gen, paged_kv, max_splits, head_major, k_rows) -> None:
    """The launch-shape switches (grid order, K tile addressed by rows) compute the same attention; with
    several splits the in-kernel merge must find each (request, kv_head) counter under either order."""
    kv = paged_kv(gen, [300, 1, 77, 530], num_kv_heads=2, head_dim=32)
    q = torch.randn((4, 8 * 32), generator=gen)
    scratch = Scratch(4, 8, 2, max_splits, 32)
    tiles = DecodeTiles(block_n=16, head_major=head_major, k_rows=k_rows)
    out = _run(kv, q, 8, max_splits, 32**-0.5, scratch=scratch, tiles=tiles)
    assert rel_error(out, _ref(kv, q, 32**-0.5)) < 1e-3
    assert scratch.counters.eq(0).all()


def test_default_launch_shapes_by_batch_size(monkeypatch) -> None:
    """One request runs 8 warps a program (bench/gpu_decode_warps.py: faster at batch 1 only; RS_DECODE_W8=0
    gives it 4 like the rest), batches below WIDE_BATCH the narrow 64-key tiles at 4, wide batches 128-key
    tiles; the tiles are otherwise the same."""
    assert tiles_for(1) == SINGLE_REQUEST_TILES == DecodeTiles(num_warps=8)
    monkeypatch.setenv(SINGLE_REQUEST_WARPS_ENV, "0")
    assert tiles_for(1) == NARROW_BATCH_TILES
    monkeypatch.delenv(SINGLE_REQUEST_WARPS_ENV)
    assert tiles_for(2) == tiles_for(WIDE_BATCH - 1) == NARROW_BATCH_TILES == DecodeTiles()
    assert tiles_for(WIDE_BATCH) == tiles_for(256) == WIDE_BATCH_TILES == DecodeTiles(block_n=128)


@pytest.mark.parametrize("max_splits", [1, 8, MAX_KV_SPLITS])
def test_decode_bfloat16_matches_reference(gen, paged_kv, bf16_dot, max_splits) -> None:
    kv = paged_kv(gen, [1050, 3, 200], num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    q = torch.randn((3, 4 * 32), generator=gen).to(torch.bfloat16)
    out = _run(kv, q, 4, max_splits, sm_scale=32**-0.5)
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 significant bits: rounding the output alone costs up to 2^-9 relative.
    assert rel_error(out, _ref(kv, q, 32**-0.5)) < 1e-2


@pytest.mark.parametrize("max_splits", [2, 8, MAX_KV_SPLITS])
def test_decode_result_does_not_depend_on_split_count(gen, paged_kv, max_splits) -> None:
    kv = paged_kv(gen, [1030, 3, 130], num_kv_heads=2, head_dim=16)
    q = torch.randn((3, 4 * 16), generator=gen)
    splits = kv_splits_per_request(kv.seq_lens, max_splits, min_tokens_per_split=TOKENS_PER_SPLIT)
    assert splits.tolist() == [max_splits, 1, min(max_splits, 9)]
    one = _run(kv, q, 4, max_splits=1, sm_scale=0.3)
    many = _run(kv, q, 4, max_splits=max_splits, sm_scale=0.3)
    assert rel_error(many, one) < 1e-5


@pytest.mark.parametrize("grid_splits", [1, 3])
def test_programs_walking_several_splits_give_the_same_bits(gen, paged_kv, grid_splits) -> None:
    """grid_splits below max_kv_splits: each program runs splits s, s + grid_splits, ...; every split's
    arithmetic and the merge's order are unchanged, and the counters end at zero."""
    kv = paged_kv(gen, [1030, 3, 130, 0], num_kv_heads=2, head_dim=16)
    q = torch.randn((4, 4 * 16), generator=gen)
    scratch = Scratch(4, 4, 2, 8, 16)
    walked = _run(kv, q, 4, 8, 0.3, scratch=scratch, grid_splits=grid_splits)
    assert torch.equal(walked, _run(kv, q, 4, 8, 0.3))
    assert rel_error(walked, _ref(kv, q, 0.3)) < 1e-3
    assert scratch.counters.eq(0).all()


@pytest.mark.parametrize("split_tokens", [0, 32])
def test_split_counts_derived_in_the_kernel_match_the_tensor(gen, paged_kv, split_tokens) -> None:
    """num_kv_splits=None: each program counts its request's splits from seq_lens (what the backends do,
    so no launches fill a tensor before the first layer). The same bits as the counts given as a tensor
    (kv_splits_per_request's, or fixed_size_kv_splits' with split_tokens), and exactly those splits write
    partials: past a request's count the poisoned scratch stays NaN."""
    lens = [1030, 3, 130, 0, 16 * 64 + 1]
    kv = paged_kv(gen, lens, num_kv_heads=2, head_dim=16)
    q = torch.randn((len(lens), 4 * 16), generator=gen)
    max_splits = 64
    if split_tokens:
        counts = fixed_size_kv_splits(kv.seq_lens, split_tokens)
    else:
        counts = kv_splits_per_request(kv.seq_lens, max_splits, min_tokens_per_split=TOKENS_PER_SPLIT)
    outs, scratches = [], []
    for splits in (counts, None):
        scratch = Scratch(len(lens), 4, 2, max_splits, 16)
        out = poisoned((len(lens), 4 * 16), q.dtype)
        decode_attention(
            q, kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, splits,
            max_splits, 0.3, scratch.part_out, scratch.part_lse, DecodeTiles(block_n=16), scratch.counters,
            split_tokens=split_tokens, min_tokens_per_split=TOKENS_PER_SPLIT,
        )  # fmt: skip
        outs.append(out)
        scratches.append(scratch)
        assert not scratch.counters.any()
    assert torch.equal(outs[0], outs[1])
    assert rel_error(outs[1], _ref(kv, q, 0.3)) < 1e-3
    expected = [min(max(-(-n // (split_tokens or TOKENS_PER_SPLIT)), 1), max_splits) for n in lens]
    assert expected == counts.clamp(max=max_splits).tolist()
    written = (~scratches[1].part_lse.isnan()).all(dim=1).sum(dim=1)  # splits with every head's lse written
    assert written.tolist() == [n if n > 1 else 0 for n in expected]  # one split writes `out` directly


def test_decode_rejects_a_split_length_below_one(gen, paged_kv) -> None:
    kv = paged_kv(gen, [10], num_kv_heads=1, head_dim=16)
    q = torch.randn((1, 16), generator=gen)
    part_out, part_lse = alloc_decode_partials(1, 1, 4, 16, "cpu")
    with pytest.raises(ValueError, match="min_tokens_per_split must be >= 1, got 0"):
        decode_attention(
            q, kv.k_buffer, kv.v_buffer, poisoned((1, 16)), kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
            None, 4, 1.0, part_out, part_lse, DecodeTiles(block_n=16), min_tokens_per_split=0,
        )  # fmt: skip


def test_decode_rejects_a_grid_wider_than_the_splits(gen, paged_kv) -> None:
    kv = paged_kv(gen, [10], num_kv_heads=1, head_dim=16)
    q = torch.randn((1, 16), generator=gen)
    with pytest.raises(ValueError, match="grid_splits must be between 1 and max_kv_splits 4, got 8"):
        _run(kv, q, 1, 4, 1.0, grid_splits=8)


def test_one_split_requests_write_out_without_scratch_or_counters(gen, paged_kv) -> None:
    # A grid bound of 8 (as for a small batch) but contexts short enough for one split each: the output
    # comes straight from the split's program, with no partials and no merge.
    kv = paged_kv(gen, [MIN_TOKENS_PER_SPLIT, 40, 1], num_kv_heads=2, head_dim=16)
    q = torch.randn((3, 4 * 16), generator=gen)
    scratch = Scratch(3, 4, 2, 8, 16)
    out = _run(kv, q, 4, max_splits=8, sm_scale=0.25, tokens_per_split=MIN_TOKENS_PER_SPLIT, scratch=scratch)
    assert rel_error(out, _ref(kv, q, 0.25)) < 1e-3
    assert scratch.part_out.isnan().all() and scratch.part_lse.isnan().all()
    assert not scratch.counters.any()


def test_split_counters_return_to_zero_and_serve_the_next_call(gen, paged_kv) -> None:
    kv = paged_kv(gen, [500, 70, 3], num_kv_heads=2, head_dim=16)
    scratch = Scratch(3, 4, 2, 8, 16)
    for _ in range(2):  # as two layers (or two CUDA-graph replays) sharing the counters
        q = torch.randn((3, 4 * 16), generator=gen)
        out = _run(kv, q, 4, max_splits=8, sm_scale=0.25, scratch=scratch)
        assert rel_error(out, _ref(kv, q, 0.25)) < 1e-3
        assert not scratch.counters.any()


def test_split_counts_above_the_grid_bound_are_clamped(gen, paged_kv) -> None:
    kv = paged_kv(gen, [300, 20], num_kv_heads=1, head_dim=16)
    q = torch.randn((2, 2 * 16), generator=gen)
    scratch = Scratch(2, 2, 1, 4, 16)
    too_many = torch.tensor([9, 5], dtype=torch.int32)
    out = _run(kv, q, 2, max_splits=4, sm_scale=0.25, scratch=scratch, splits=too_many)
    assert rel_error(out, _ref(kv, q, 0.25)) < 1e-3
    assert not scratch.counters.any()


def test_decode_allocates_counters_when_none_are_given(gen, paged_kv) -> None:
    kv = paged_kv(gen, [400, 9], num_kv_heads=2, head_dim=16)
    q = torch.randn((2, 4 * 16), generator=gen)
    splits = kv_splits_per_request(kv.seq_lens, 4, min_tokens_per_split=TOKENS_PER_SPLIT)
    part_out, part_lse = alloc_decode_partials(2, 4, 4, 16, "cpu")
    out = poisoned((2, 4 * 16))
    decode_attention(
        q, kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        splits, 4, 0.25, part_out, part_lse, DecodeTiles(block_n=16),
    )  # fmt: skip
    assert rel_error(out, _ref(kv, q, 0.25)) < 1e-3


def test_decode_rejects_counters_of_the_wrong_type(gen, paged_kv) -> None:
    kv = paged_kv(gen, [40], num_kv_heads=2, head_dim=16)
    q = torch.randn((1, 4 * 16), generator=gen)
    scratch = Scratch(1, 4, 2, 4, 16)
    scratch.counters = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="split_counters"):
        _run(kv, q, 4, max_splits=4, sm_scale=0.25, scratch=scratch)


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
