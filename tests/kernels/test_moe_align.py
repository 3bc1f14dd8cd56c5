"""The sorted MoE layout's Triton kernel (kernels/moe_blocks.align_tokens_by_expert_kernel) against its
torch form, bit for bit, under the Triton interpreter. Each case runs a few dozen programs in Python, so
the shapes are spread over the cases rather than crossed: every T, k, E and block_m appears several times."""

from __future__ import annotations

import pytest
import torch

import kernels.fused_moe as fm
import kernels.moe_blocks as mb
from kernels.moe_blocks import (
    MoeTiles,
    align_tokens_by_expert,
    align_tokens_by_expert_kernel,
    align_tokens_by_expert_torch,
    moe_tiles_for,
)
from kernels.reference import fused_moe_ref
from tests.kernels.conftest import rel_error


def routed(gen: torch.Generator, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """Distinct experts per token, as top-k routing gives."""
    return torch.rand((tokens, experts), generator=gen).topk(top_k, dim=-1).indices


def assert_kernel_matches_torch(ids: torch.Tensor, experts: int, block_m: int) -> None:
    out = align_tokens_by_expert_kernel(ids, experts, block_m)
    ref = align_tokens_by_expert_torch(ids, experts, block_m)
    for name, got, want in zip(("sorted_ids", "expert_ids", "num_padded"), out, ref):
        assert got.dtype == want.dtype == torch.int32, name
        assert got.shape == want.shape, name
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"


# (tokens, top_k, experts, block_m): every (T, k) pair once; E and block_m rotate through all values.
CASES = [
    (1, 1, 8, 16),
    (1, 2, 60, 32),
    (1, 8, 256, 64),
    (5, 1, 128, 32),
    (5, 2, 256, 16),
    (5, 8, 8, 64),
    (64, 1, 60, 64),
    (64, 2, 8, 32),
    (64, 8, 256, 16),
    (300, 1, 256, 32),
    (300, 2, 128, 64),
    (300, 8, 128, 16),
    (300, 8, 60, 32),
]


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), CASES)
def test_kernel_matches_torch(gen, tokens, top_k, experts, block_m) -> None:
    assert_kernel_matches_torch(routed(gen, tokens, experts, top_k), experts, block_m)


def test_layout_of_a_small_routing() -> None:
    """Pairs 0..5 go to experts 2, 0, 2, 1, 0, 2; expert 3 gets none. With blocks of 2 rows: expert 0's
    run is pairs 1, 4; expert 1's is pair 3 and a sentinel (6); expert 2's is pairs 0, 2, 5, sentinel."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, expert_ids, num_padded = align_tokens_by_expert_kernel(ids, 4, 2)
    assert sorted_ids.tolist() == [1, 4, 3, 6, 0, 2, 5, 6, 6, 6]  # 10 rows: 6 pairs + 4 experts x 1
    assert expert_ids.tolist() == [0, 1, 2, 2, -1]
    assert num_padded.tolist() == [8]


@pytest.mark.parametrize("expert", [0, 37, 59])
def test_all_pairs_in_one_expert(expert) -> None:
    ids = torch.full((300, 2), expert)
    assert_kernel_matches_torch(ids, 60, 16)
    _, expert_ids, num_padded = align_tokens_by_expert_kernel(ids, 60, 16)
    assert num_padded.item() == 608 and (expert_ids[:38] == expert).all() and (expert_ids[38:] == -1).all()


def test_most_experts_without_pairs(gen) -> None:
    """Three experts of 256 used, unevenly (runs of one pair, a full block, many blocks)."""
    choice = torch.tensor([3, 100, 100, 255, 255, 255, 255])
    ids = choice[torch.randint(0, len(choice), (64, 8), generator=gen)]
    assert_kernel_matches_torch(ids, 256, 32)
    assert_kernel_matches_torch(torch.tensor([[5, 9]]), 256, 64)


@pytest.mark.parametrize("skewed", [False, True])
def test_several_tiles_per_program(gen, monkeypatch, skewed) -> None:
    """Past _ALIGN_PROGRAMS tiles of pairs each program sorts several, carrying its counts from one to
    the next; three programs for 2400 pairs make that happen at a test's size."""
    monkeypatch.setattr(mb, "_ALIGN_PROGRAMS", 3)
    ids = torch.randint(0, 3, (300, 8), generator=gen) if skewed else routed(gen, 300, 60, 8)
    assert_kernel_matches_torch(ids, 60, 32)


@pytest.mark.parametrize(("experts", "block_m"), [(5, 1), (5, 4), (5, 24), (1, 16), (1024, 16)])
def test_odd_block_sizes_and_expert_counts(gen, experts, block_m) -> None:
    assert_kernel_matches_torch(torch.randint(0, experts, (11, 2), generator=gen), experts, block_m)


def test_int32_ids_and_no_pairs(gen) -> None:
    assert_kernel_matches_torch(routed(gen, 33, 60, 4).to(torch.int32), 60, 16)
    assert_kernel_matches_torch(torch.zeros((0, 8), dtype=torch.int64), 60, 16)


def test_block_sizes_moe_tiles_for_picks(gen) -> None:
    """The decode-to-prefill range fused_moe sorts at, with the block_m it would pick."""
    for tokens, experts in ((64, 128), (300, 256)):
        block_m = moe_tiles_for(tokens * 8, experts).block_m
        assert_kernel_matches_torch(routed(gen, tokens, experts, 8), experts, block_m)


def test_fused_moe_runs_on_the_kernel_layout(gen, monkeypatch) -> None:
    """fused_moe's GEMMs on the kernel's layout, as on CUDA: the torch layout's output, bit for bit."""
    tokens, experts, top_k, hidden, inter = 13, 6, 2, 32, 48
    x = torch.randn((tokens, hidden), generator=gen)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    ids = routed(gen, tokens, experts, top_k)
    weights = torch.rand((tokens, top_k), generator=gen)
    tiles = MoeTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    ref = fm.fused_moe(x, w13, w2, weights, ids, tiles, pair_per_block=False)
    monkeypatch.setattr(fm, "align_tokens_by_expert", align_tokens_by_expert_kernel)
    out = fm.fused_moe(x, w13, w2, weights, ids, tiles, pair_per_block=False)
    assert torch.equal(out, ref)
    assert rel_error(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


def test_dispatch_off_cuda_is_the_torch_form(gen) -> None:
    ids = routed(gen, 9, 60, 8)
    for got, want in zip(align_tokens_by_expert(ids, 60, 16), align_tokens_by_expert_torch(ids, 60, 16)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("align", [align_tokens_by_expert, align_tokens_by_expert_kernel])
@pytest.mark.parametrize(
    ("ids", "experts", "block_m", "match"),
    [
        (torch.zeros((2, 2)), 8, 16, "must be int32 or int64"),
        (torch.tensor([[0, 8]]), 8, 16, "must lie in \\[0, 8\\)"),
        (torch.tensor([[-1, 3]]), 8, 16, "must lie in \\[0, 8\\)"),
        (torch.tensor([[0, 1]]), 0, 16, "num_experts must be positive"),
        (torch.tensor([[0, 1]]), 8, 0, "block_m must be positive"),
    ],
)
def test_bad_input_is_a_value_error(align, ids, experts, block_m, match) -> None:
    with pytest.raises(ValueError, match=match):
        align(ids, experts, block_m)


def test_too_many_experts_for_the_kernel_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at most 1024"):
        align_tokens_by_expert_kernel(torch.tensor([[0, 1]]), 1025, 16)
