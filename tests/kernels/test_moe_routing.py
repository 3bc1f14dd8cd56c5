"""One-launch MoE routing (kernels/moe_routing.py) against torch's softmax + top-k, under the Triton
interpreter. The interpreter runs each token's program in Python (~15 ms at k = 8), so the shapes are
spread over a few cases rather than crossed."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import moe_topk_softmax
from services.worker.runtime.layers.moe import select_experts


def reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's probabilities of the ids a stable descending sort of the logits puts first: the kernel's
    stated order, ties to the lower id (torch.topk on the CPU breaks ties in no fixed way)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def assert_routes_like_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    weights, ids = moe_topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = reference(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)
    # The production torch path keeps the same weights, whichever of tied ids it picked.
    torch_weights, _ = select_experts(logits, top_k, renormalize)
    torch.testing.assert_close(weights, torch_weights, rtol=2e-6, atol=1e-7)


# (tokens, experts, top_k, renormalize, logits dtype): every T, E, k, flag and dtype appears at least once.
CASES = [
    (1, 8, 1, True, torch.float32),
    (1, 256, 8, False, torch.float32),
    (1, 256, 8, True, torch.bfloat16),
    (7, 60, 4, False, torch.bfloat16),
    (7, 128, 8, True, torch.float32),
    (64, 8, 2, True, torch.bfloat16),
    (64, 128, 1, False, torch.float32),
    (64, 256, 8, False, torch.bfloat16),
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize", "dtype"), CASES)
def test_routing_matches_torch(gen, tokens, experts, top_k, renormalize, dtype) -> None:
    logits = (torch.randn((tokens, experts), generator=gen) * 2).to(dtype)
    assert_routes_like_reference(logits, top_k, renormalize)


@pytest.mark.parametrize("renormalize", [False, True])
def test_ties_go_to_the_lower_expert_id(gen, renormalize) -> None:
    logits = torch.randint(-2, 3, (5, 60), generator=gen).float()  # five distinct values: ties everywhere
    assert_routes_like_reference(logits, 8, renormalize)
    weights, ids = moe_topk_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0]]), 5, renormalize)
    assert ids.tolist() == [[1, 2, 4, 5, 6]]
    weights, ids = moe_topk_softmax(torch.zeros((1, 16)), 4, renormalize)
    assert ids.tolist() == [[0, 1, 2, 3]]
    torch.testing.assert_close(weights, torch.full((1, 4), 0.25 if renormalize else 1 / 16))


def test_signed_zeros_tie_and_minus_inf_experts_come_last() -> None:
    inf = float("inf")
    logits = torch.tensor([[-inf, -0.0, -inf, 0.0, 1.0, -inf]])
    weights, ids = moe_topk_softmax(logits, 5, renormalize=False)
    assert ids.tolist() == [[4, 1, 3, 0, 2]]
    torch.testing.assert_close(weights, reference(logits, 5, False)[0])
    assert weights[0, 3:].tolist() == [0.0, 0.0]


def test_strided_logits_and_int32_ids(gen) -> None:
    wide = torch.randn((7, 2 * 60), generator=gen)
    logits = wide[:, ::2]  # a column stride of 2
    weights, ids = moe_topk_softmax(logits, 4, renormalize=True, ids_dtype=torch.int32)
    ref_weights, ref_ids = reference(logits, 4, True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)


def test_no_tokens_gives_empty_outputs() -> None:
    weights, ids = moe_topk_softmax(torch.empty((0, 128)), 8, renormalize=True)
    assert weights.shape == ids.shape == (0, 8)


@pytest.mark.parametrize(
    ("logits", "top_k", "match"),
    [
        (torch.zeros(8), 2, "must be \\[tokens, experts\\]"),
        (torch.zeros((2, 3, 8)), 2, "must be \\[tokens, experts\\]"),
        (torch.zeros((2, 8)), 9, "top_k must be in"),
        (torch.zeros((2, 64)), 17, "top_k must be in"),
        (torch.zeros((2, 8)), 0, "top_k must be in"),
        (torch.zeros((2, 2048)), 8, "num_experts must be in"),
        (torch.zeros((2, 8), dtype=torch.int64), 2, "must be float32, bfloat16 or float16"),
    ],
)
def test_bad_input_is_a_value_error(logits, top_k, match) -> None:
    with pytest.raises(ValueError, match=match):
        moe_topk_softmax(logits, top_k, renormalize=True)


def test_bad_ids_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="ids_dtype"):
        moe_topk_softmax(torch.zeros((2, 8)), 2, renormalize=True, ids_dtype=torch.float32)
