"""Fused MoE (expert sorting + two grouped GEMMs) against the float32 reference (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import MoeTiles, align_tokens_by_expert, fused_moe
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


def test_fused_moe_rejects_mismatched_weights(gen) -> None:
    x = torch.randn((2, 16), generator=gen)
    weights, ids = _routing(gen, 2, 4, 2)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, torch.randn(4, 32, 16), torch.randn(4, 16, 8), weights, ids)
