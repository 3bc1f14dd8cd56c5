"""MoE routing in one launch: softmax over the router logits, the top k experts, optionally renormalized.

The torch form (layers/moe.py's select_experts: softmax, topk, sum, divide) is four or five launches per
MoE layer; at batch-1 decode each costs more than its work, even inside a CUDA graph. One program here
handles one token's row, held in registers (up to MAX_EXPERTS logits).

Softmax is monotonic, so the top k of the probabilities are the top k of the logits, and the largest
logit is the softmax's max. The kernel therefore picks on the logits first and exponentiates k values:
weight_j = exp(x_j - x_max) / D, with D = sum_e exp(x_e - x_max) over all experts, or, renormalized,
D = sum over the k picked (the full sum cancels, so it is not computed at all).

Order and ties: ids come out by descending logit (float32, after widening bfloat16 / float16 exactly);
among equal logits the lowest expert id comes first, so a stable descending sort of the logits gives
the same ids (torch.topk on CUDA breaks ties the same way in practice, on the CPU it does not). Each
pick is one max-reduction over a 64-bit key: the logit's float32 bits mapped to an order-preserving
int32 in the high word, (BLOCK_E - 1 - id) in the low word; -0.0 counts as +0.0. Where two distinct
logits round to the same probability in torch, torch sees a tie and this kernel the larger logit; the
weights then agree to an ulp. A row of all -inf logits gives NaN weights, as torch does.

No host sync and outputs shaped by [T, k] only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOP_K = 16
MAX_EXPERTS = 1024
# Below every real key (-inf's included): padding lanes and picked experts are never picked again.
_TAKEN = tl.constexpr(-(2**63))


@triton.jit
def _moe_routing_kernel(
    Logits,
    Weights,
    Ids,
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    in_row = offs < num_experts
    x = tl.load(Logits + row * stride_lt + offs * stride_le, mask=in_row, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 tie, as their probabilities do
    # Order-preserving int32 of a float: negative floats have every bit but the sign flipped.
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = (BLOCK_E - 1 - offs).to(tl.int64)
    keys = (ordered.to(tl.int64) << 32) | low
    taken = tl.full([BLOCK_E], _TAKEN, tl.int64)
    keys = tl.where(in_row, keys, taken)

    slots = tl.arange(0, BLOCK_K)
    picked_ids = tl.zeros([BLOCK_K], tl.int32)
    picked_x = tl.full([BLOCK_K], float("-inf"), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        expert = BLOCK_E - 1 - best.to(tl.int32)  # the low word (< 2**31)
        high = (best >> 32).to(tl.int32)
        value = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        picked_ids = tl.where(slots == j, expert, picked_ids)
        picked_x = tl.where(slots == j, value, picked_x)
        keys = tl.where(offs == expert, taken, keys)

    x_max = tl.max(picked_x, 0)  # the first pick: the row's largest logit
    e = tl.exp(picked_x - x_max)  # unused slots: exp(-inf) = 0
    if RENORMALIZE:
        denom = tl.sum(e, 0)
    else:
        denom = tl.sum(tl.exp(x - x_max), 0)  # padding lanes hold -inf: they add 0
    out = row * TOP_K + slots
    keep = slots < TOP_K
    tl.store(Weights + out, e / denom, mask=keep)
    tl.store(Ids + out, picked_ids.to(Ids.dtype.element_ty), mask=keep)


def moe_topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    ids_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] float32, topk_ids [T, k] ids_dtype) for router_logits [T, E].

    topk_weights are the softmax probabilities of each token's k largest logits (renormalize: divided
    by their sum), largest first, ties to the lower expert id (see the module docstring). ids_dtype is
    int64 by default, as torch.topk and the CPU path return and as kernels/moe_blocks.py's sorted layout
    widens to (int32 would cost it a cast launch); fused_moe reads either."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"router_logits must be float32, bfloat16 or float16, got {router_logits.dtype}")
    if ids_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"top_k must be in [1, min({MAX_TOP_K}, num_experts={num_experts})], got {top_k}")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=ids_dtype, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _moe_routing_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        router_logits.stride(1),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        # One warp up to 512 experts: every reduction stays in warp shuffles.
        num_warps=1 if block_e <= 512 else 4,
    )
    return weights, ids
