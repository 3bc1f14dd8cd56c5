"""Fused mixture-of-experts MLP: sort (token, expert) pairs by expert, then two grouped GEMMs.

Each token picks k experts, so there are T*k (token, expert) pairs; pair p = t*k + j. The pipeline:

1. align_tokens_by_expert (torch ops, no host sync): order the pairs by expert and pad every expert's run
   to a multiple of BLOCK_M with a sentinel id (T*k), so each BLOCK_M-row block belongs to one expert;
   expert_ids[block] names it.
2. Up GEMM: for each block, gather its tokens' hidden rows, multiply by that expert's gate and up rows of
   w13 in the same program (two accumulators) and write silu(gate) * up: the [pairs, 2I] intermediate
   never reaches memory.
3. Down GEMM: the same kernel over the activations (rows are pair ids now), times the expert weight of
   each pair, written per pair; a sum over k gives the output. Summing per token instead of atomically
   adding keeps the result deterministic.

Blocks past the padded total exit at once, so the grid is sized from shapes alone (CUDA-graph safe).
Program ids walk GROUP_M row blocks before moving along N, so blocks of one expert reuse its weight
tiles from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision


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


def moe_tiles_for(num_pairs: int, num_experts: int) -> MoeTiles:
    """Few pairs per expert (decode): short row blocks, so padding does not multiply the work; the
    kernel then streams weights, and a narrow N with a long K keeps many loads in flight."""
    if num_pairs <= 2 * num_experts:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if num_pairs <= 16 * num_experts:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return MoeTiles()


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


@triton.jit
def _moe_gemm_kernel(
    A,
    B,
    C,
    Sorted_ids,
    Expert_ids,
    Num_padded,
    Pair_weights,
    N,
    K,
    num_pairs,
    a_rows_per_pair,
    num_m_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[pair, :N] = A[pair // a_rows_per_pair] @ B[expert].T for the pairs of each row block.
    GATED: B holds 2N rows (gate, then up) and C gets silu(gate) * up. WEIGHTED: rows are scaled by
    Pair_weights[pair]."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n_blocks
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    if pid_m * BLOCK_M < tl.load(Num_padded):
        expert = tl.load(Expert_ids + pid_m).to(tl.int64)
        pairs = tl.load(Sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = (pairs // a_rows_per_pair).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if WEIGHTED:
            acc = acc * tl.load(Pair_weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(
            C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
            acc.to(C.dtype.element_ty),
            mask=valid[:, None] & n_mask[None, :],
        )


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    pair_weights: torch.Tensor | None,
    a_rows_per_pair: int,
    gated: bool,
    tiles: MoeTiles,
) -> None:
    n = c.shape[1]
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        sorted_ids,
        expert_ids,
        num_padded,
        pair_weights if pair_weights is not None else c,
        n,
        a.shape[1],
        c.shape[0],
        a_rows_per_pair,
        num_m_blocks,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        GATED=gated,
        WEIGHTED=pair_weights is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | None = None,
    sum_in_order: bool = False,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * w2[e_j] @ silu_and_mul(w13[e_j] @ x) for each token x.
    sum_in_order: add the k expert outputs j = 0, 1, ... one after another (deterministic inference: a
    reduction kernel over k may split it differently for another number of tokens).

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights, topk_ids [T, k].
    Same contract as services.worker.runtime.layers.moe.moe_forward; returns [T, H] in hidden's dtype.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden size {hidden_size}: expected "
            f"w13 [E, 2I, {hidden_size}] and w2 [E, {hidden_size}, I]"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights must both be [{num_tokens}, k]")
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last axis must be contiguous")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    tiles = tiles or moe_tiles_for(num_pairs, num_experts)
    sorted_ids, expert_ids, num_padded = align_tokens_by_expert(topk_ids, num_experts, tiles.block_m)
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, act, sorted_ids, expert_ids, num_padded, None, top_k, True, tiles)
    per_pair = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, per_pair, sorted_ids, expert_ids, num_padded, weights, 1, False, tiles)
    per_token = per_pair.view(num_tokens, top_k, hidden_size)
    if not sum_in_order:
        return per_token.sum(dim=1)
    out = per_token[:, 0].clone()
    for j in range(1, top_k):
        out += per_token[:, j]
    return out
