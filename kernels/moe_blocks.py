"""How the fused MoE's (token, expert) pairs fill the grouped GEMMs' row blocks (kernels/fused_moe.py).

Each BLOCK_M-row block of the two GEMMs belongs to one expert. Two layouts:
- sorted (align_tokens_by_expert): the pairs ordered by expert, each expert's run padded to a multiple of
  BLOCK_M. Every expert's weights are read once per block of its pairs, at the price of 28 small torch
  launches to sort (bench/cpu_moe_launches.py), at batch 1 more than the rest of the MoE block.
- one pair per block (one_pair_per_block): pair p alone in block p, at row 0. The layout is the
  shape's own, so the GEMM kernel derives it from its program id and reads the expert of block p from
  topk_ids itself: no launch at all before the GEMMs. Two pairs of one expert then read its weights
  twice, so this is for decode-sized batches only.

Plus the launch shapes (MoeTiles) the two GEMMs run with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# The one-pair-per-block layout's limit on T * k, past one token (see one_pair_per_block).
DECODE_MAX_PAIRS = 64


@dataclass(frozen=True)
class MoeTiles:
    """One grouped GEMM's launch shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Deterministic inference: one launch shape whatever the batch (moe_tiles_for's choice varies with it).
DETERMINISTIC_MOE_TILES = MoeTiles()


def moe_tiles_for(num_pairs: int, num_experts: int, fp8: bool = False) -> MoeTiles:
    """Few pairs per expert (decode): short row blocks, so padding does not multiply the work; the
    kernel then streams weights, and a narrow N with a long K keeps many loads in flight.

    FP8 experts get their own: each K step's scaled product needs registers of its own beside the two
    accumulators of the gated GEMM, and the bf16 tiles spilled with it when compiled for sm90 (checked
    offline with ptxas; these do not)."""
    if fp8:
        if num_pairs <= 2 * num_experts:
            return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=8, num_stages=3)
        if num_pairs <= 16 * num_experts:
            return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoeTiles(block_m=64, block_n=64, block_k=128, num_warps=8, num_stages=3)
    if num_pairs <= 2 * num_experts:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if num_pairs <= 16 * num_experts:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return MoeTiles()


def one_pair_per_block(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether fused_moe gives every pair a block of its own (no sorting launches) by default.

    One token: always. Its k experts are distinct (top-k), so the sorted layout would hold one pair per
    block too: the same blocks, the same weight reads, minus the sort.

    More tokens: while T * k <= min(DECODE_MAX_PAIRS, E / 4). Two pairs that share an expert cost a
    second read of its weights; with uniform routing the expected share of such reads is about
    (T - 1) k / 2E < T k / 2E, at most 1/8 under E / 4 (Qwen3.5-35B-A3B, 256 experts top-8: up to 8
    tokens; Qwen3-30B-A3B, 128 top-8: 4). The cap of 64 pairs bounds the extra bytes where E is large:
    at 35B-A3B's 6 MB bf16 experts, 1/8 of 64 reads is ~8 extra (~10 us at 4.8 TB/s), less than the
    sort's 28 launches cost even inside a CUDA graph (~1 us or more each, estimated, not measured).
    Skewed routing shares more experts; the cap keeps that case small too.
    """
    if num_tokens <= 1:
        return True
    return num_tokens * top_k <= min(DECODE_MAX_PAIRS, num_experts // 4)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """A ValueError for ids that are not integers, or (off CUDA, where reading them costs no sync) not
    experts. On CUDA a bad id makes the sorted layout's scatter fault; the other layout asserts it under
    TRITON_DEBUG=1 and reads out of bounds otherwise."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.is_cuda or topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got ids from {low} to {high}")


def align_tokens_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded) for topk_ids [T, k].

    sorted_ids [max_padded] int32: pair ids grouped by expert, each expert's run padded to a multiple of
    block_m with the sentinel T*k (and the unused tail filled with it too); expert_ids [max_padded /
    block_m] int32: the expert of each block (-1 past the end); num_padded [1] int32: rows in use.
    """
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    device = flat.device
    # scatter_add rather than bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_start = counts.cumsum(0) - counts
    rank = torch.arange(n, device=device) - run_start[sorted_experts]
    dest = (padded_end - padded_counts)[sorted_experts] + rank
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)
