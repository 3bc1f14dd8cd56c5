"""Fused MoE (expert sorting + two grouped GEMMs) against the float32 reference (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import (
    DETERMINISTIC_MOE_TILES,
    MoeTiles,
    align_tokens_by_expert,
    combine_experts,
    fused_moe,
    one_pair_per_block,
)
from kernels.reference import fused_moe_ref
from tests.kernels.conftest import rel_error

SMALL = MoeTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


def _routing(
    gen: torch.Generator, tokens: int, experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as top-k gives), with the last expert never chosen."""
    scores = torch.rand((tokens, experts), generator=gen)
    scores[:, -1] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def test_alignment_puts_every_pair_once_in_a_block_of_its_expert(gen) -> None:
    tokens, experts, top_k, block_m = 11, 5, 2, 4
    _, ids = _routing(gen, tokens, experts, top_k)
    sorted_ids, expert_ids, num_padded = align_tokens_by_expert(ids, experts, block_m)
    used = int(num_padded)
    assert used % block_m == 0
    flat = ids.flatten()
    real = sorted_ids[:used][sorted_ids[:used] < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))
    assert (sorted_ids[used:] == tokens * top_k).all()
    for block in range(used // block_m):
        pairs = sorted_ids[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < tokens * top_k]
        assert len(pairs) > 0 and (flat[pairs.long()] == expert_ids[block]).all()
    assert (expert_ids[used // block_m :] == -1).all()


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(13, 6, 2, 32, 48), (3, 8, 4, 40, 24), (1, 4, 1, 16, 16)],  # sizes off the tile grid; one token
)
def test_fused_moe_matches_reference(gen, tokens, experts, top_k, hidden, inter) -> None:
    x = torch.randn((tokens, hidden), generator=gen)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    weights, ids = _routing(gen, tokens, experts, top_k)
    out = fused_moe(x, w13, w2, weights, ids, SMALL)
    assert out.shape == (tokens, hidden)
    assert rel_error(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


def test_fused_moe_with_default_tiles_matches_reference(gen) -> None:
    x = torch.randn((5, 64), generator=gen)
    w13 = torch.randn((4, 2 * 64, 64), generator=gen) / 8
    w2 = torch.randn((4, 64, 64), generator=gen) / 8
    weights, ids = _routing(gen, 5, 4, 2)
    assert rel_error(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4


def _experts(gen: torch.Generator, experts: int, hidden: int, inter: int, dtype: torch.dtype):
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def test_one_pair_per_block_is_the_default_for_decode_sized_batches() -> None:
    assert one_pair_per_block(1, 8, 8)  # one token: top-k experts are distinct, one pair per block anyway
    assert one_pair_per_block(1, 10, 512)  # past the cap of 64 pairs / E / 4 only with more tokens
    assert one_pair_per_block(8, 8, 256)  # Qwen3.5-35B-A3B: 64 pairs, E / 4 = 64
    assert not one_pair_per_block(9, 8, 256)  # past the 64-pair cap
    assert one_pair_per_block(4, 8, 128) and not one_pair_per_block(5, 8, 128)  # Qwen3-30B-A3B: E / 4
    assert not one_pair_per_block(9, 8, 1024)  # the cap holds for many experts too
    assert not one_pair_per_block(2, 2, 8)  # few experts: pairs would share them


# Float32 on the fast tiles; deterministic inference's fixed tiles and ordered sum in each dtype (float16
# and bfloat16 products are exact in float32, so the row_dot model is what the tensor cores compute).
@pytest.mark.parametrize(
    ("tiles", "sum_in_order", "dtype"),
    [
        (SMALL, False, torch.float32),
        (DETERMINISTIC_MOE_TILES, True, torch.float32),
        (DETERMINISTIC_MOE_TILES, True, torch.float16),
        (DETERMINISTIC_MOE_TILES, True, torch.bfloat16),
    ],
)
def test_one_pair_per_block_matches_the_sorted_layout_bit_for_bit(
    gen, row_dot, tiles, sum_in_order, dtype
) -> None:
    # 9 tokens on 4 experts, top-2: sorted, each expert's blocks hold several pairs at other rows.
    tokens, experts, top_k, hidden, inter = 9, 4, 2, 40, 24
    x = torch.randn((tokens, hidden), generator=gen).to(dtype)
    w13, w2 = _experts(gen, experts, hidden, inter, dtype)
    weights, ids = _routing(gen, tokens, experts, top_k)
    kw = dict(tiles=tiles, sum_in_order=sum_in_order)
    fast = fused_moe(x, w13, w2, weights, ids, pair_per_block=True, **kw)
    assert torch.equal(fast, fused_moe(x, w13, w2, weights, ids, pair_per_block=False, **kw))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_error(fast.float(), fused_moe_ref(x, w13, w2, weights, ids)) < tolerance
    # Deterministic inference: a token decoded alone (one pair per block) is its row of the batch.
    for t in (0, 5, 8):
        alone = fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], **kw)
        assert torch.equal(alone[0], fast[t])


def test_one_pair_per_block_reads_strided_ids_and_gives_one_expert_per_token(gen) -> None:
    x = torch.randn((3, 32), generator=gen)
    w13, w2 = _experts(gen, 4, 32, 16, torch.float32)
    weights, ids = _routing(gen, 3, 4, 2)
    strided = torch.stack([ids, ids], dim=-1)[..., 0].to(torch.int32)  # int32 ids, not contiguous
    out = fused_moe(x, w13, w2, weights, strided, SMALL, pair_per_block=True)
    assert rel_error(out, fused_moe_ref(x, w13, w2, weights, ids)) < 1e-4
    top1 = fused_moe(x, w13, w2, weights[:, :1], ids[:, :1], SMALL)  # k = 1: the pairs are the tokens
    assert rel_error(top1, fused_moe_ref(x, w13, w2, weights[:, :1], ids[:, :1])) < 1e-4


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_sums_the_experts_and_adds_the_gated_shared_expert(gen, top_k, dtype) -> None:
    # Each token's k outputs summed in float32 (then one rounding), plus sigmoid(gate) * shared_out.
    tokens, hidden = 5, 1100  # two column blocks, the second partial
    per_pair = torch.randn((tokens * top_k, hidden), generator=gen).to(dtype)
    shared_out = torch.randn((tokens, hidden), generator=gen).to(dtype)
    gate = torch.randn((tokens, 1), generator=gen).to(dtype)
    summed = per_pair.double().view(tokens, top_k, hidden).sum(1)
    with_shared = summed + torch.sigmoid(gate.double()) * shared_out.double()
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    for shared, ref in ((None, summed), ((shared_out, gate), with_shared)):
        out = combine_experts(per_pair, top_k, shared)
        assert out.dtype == dtype and out.shape == (tokens, hidden)
        assert ((out.double() - ref).abs() <= tol * ref.abs().clamp(min=1.0)).all()
    with pytest.raises(ValueError, match=r"shared: expected shared_out \[5, 1100\]"):
        combine_experts(per_pair, top_k, (shared_out[:, :100], gate))
    with pytest.raises(ValueError, match=r"gate \[5, 1\]"):
        combine_experts(per_pair, top_k, (shared_out, gate.view(1, 5)))


@pytest.mark.parametrize("sum_in_order", [False, True])
def test_fused_moe_adds_a_gated_shared_expert(gen, sum_in_order) -> None:
    tokens, experts, top_k, hidden, inter = 6, 5, 2, 32, 24
    x = torch.randn((tokens, hidden), generator=gen)
    w13 = torch.randn((experts, 2 * inter, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((experts, hidden, inter), generator=gen) / inter**0.5
    weights, ids = _routing(gen, tokens, experts, top_k)
    shared_out, gate = torch.randn((tokens, hidden), generator=gen), torch.randn((tokens, 1), generator=gen)
    out = fused_moe(x, w13, w2, weights, ids, SMALL, sum_in_order, shared=(shared_out, gate))
    ref = fused_moe_ref(x, w13, w2, weights, ids) + torch.sigmoid(gate) * shared_out
    assert rel_error(out, ref) < 1e-4


def test_fused_moe_rejects_mismatched_weights(gen) -> None:
    x = torch.randn((2, 16), generator=gen)
    weights, ids = _routing(gen, 2, 4, 2)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, torch.randn(4, 32, 16), torch.randn(4, 16, 8), weights, ids)


@pytest.mark.parametrize("pair_per_block", [True, False])
def test_fused_moe_rejects_ids_that_are_not_experts(gen, pair_per_block) -> None:
    x = torch.randn((2, 16), generator=gen)
    w13, w2 = _experts(gen, 4, 16, 16, torch.float32)
    weights, ids = _routing(gen, 2, 4, 2)
    for bad in (4, -1):
        wrong = ids.clone()
        wrong[1, 0] = bad
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
            fused_moe(x, w13, w2, weights, wrong, SMALL, pair_per_block=pair_per_block)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, w13, w2, weights, ids.float(), SMALL, pair_per_block=pair_per_block)
