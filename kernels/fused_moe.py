"""Fused mixture-of-experts MLP: (token, expert) pairs in row blocks by expert, then two grouped GEMMs.

Each token picks k experts, so there are T*k (token, expert) pairs; pair p = t*k + j. The pipeline:

1. Lay the pairs out in BLOCK_M-row blocks of one expert each (kernels/moe_blocks.py). Sorted:
   align_tokens_by_expert (one Triton launch on CUDA, torch ops elsewhere; no host sync) orders them by
   expert, every expert's run padded to a multiple of BLOCK_M with a sentinel id (T*k); expert_ids[block]
   names its expert. Decode fast path (one_pair_per_block: one token, or T*k <= min(64, E/4)): pair p
   alone at row 0 of block p. The kernel derives that from its program id (PAIR_PER_BLOCK) and reads the
   expert from topk_ids: no launch before the GEMMs, nothing cached, CUDA-graph safe. A row's product
   does not depend on the other rows of its block, so both layouts agree bit for bit with the same tiles
   (tested, fixed deterministic tiles and FP8 forms included): a token alone still matches itself in a
   batch. Pairs sharing an expert read its weights once each, hence the limit.
2. Up GEMM: for each block, gather its tokens' hidden rows, multiply by that expert's gate and up rows of
   w13 in the same program (two accumulators) and write silu(gate) * up: the [pairs, 2I] intermediate
   never reaches memory.
3. Down GEMM: the same kernel over the activations (rows are pair ids now), times the expert weight of
   each pair, written per pair; a sum over k gives the output. Summing per token instead of atomically
   adding keeps the result deterministic.

Blocks past the padded total exit at once, so the grid is sized from shapes alone (CUDA-graph safe).
Program ids walk GROUP_M row blocks before moving along N, so blocks of one expert reuse its weight
tiles from L2.

Block-wise FP8 experts (w13_scale_inv / w2_scale_inv / block_size, as Qwen3-MoE-FP8 publishes them: each
expert's weight in float8_e4m3fn with a float32 scale per [bn, bk] block). BLOCK_K divides bk, so each
K step meets one block column, and its product is scaled before it joins the float32 sum. Two forms:
- w8a8 (SGLang's only form for block FP8): each GEMM's input is quantized per token in groups of bk
  (kernels/fp8_gemm.per_token_group_quant_fp8) and the product runs fp8 x fp8 on the tensor cores,
  scaled by a_scale[row] * w_scale[col] per step.
- weight-only: the input stays in its dtype and each weight tile is converted to it (exact: e4m3 fits
  in bf16/f16), scaled by w_scale[col] per step. No quantization launches and no activation rounding;
  deterministic inference's form (layers/moe.py), since it does not change with the batch.
w8a8 is the default at every size: on an H100 (bench/gpu_fp8.py --quick, 2026-12-06, Qwen3-30B-A3B experts,
padding rows masked) one token 31.2 vs 31.6 us, 64 tokens 290 vs 304, 1,024 tokens 324 vs 605 (bf16 39.5,
418, 504). Before the padding rows were masked they read row 0 of the input, and weight-only won at 64
tokens (428 vs 566 us).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.fp8_gemm import per_token_group_quant_fp8
from kernels.fp8_gemv import pow2_divisor
from kernels.fp8_reference import FP8_DTYPE
from kernels.moe_blocks import (
    DETERMINISTIC_MOE_TILES,
    MoeTiles,
    align_tokens_by_expert,
    check_expert_ids,
    moe_tiles_for,
    one_pair_per_block,
)
from kernels.pdl import launch_options, pdl_enter, pdl_mode

__all__ = [
    "DETERMINISTIC_MOE_TILES",
    "MoeTiles",
    "align_tokens_by_expert",
    "combine_experts",
    "fused_moe",
    "moe_tiles_for",
    "one_pair_per_block",
]


@triton.jit
def _accumulate(
    acc, a, b, a_s, b_s, A_FP8: tl.constexpr, B_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    B_SCALE_PER_TILE: tl.constexpr,
):
    """acc + a @ b for one K step; FP8 weights: the step's product times its block scales (b_s one scalar
    where the tile's columns lie in one weight block, B_SCALE_PER_TILE: one multiply per element, not two)."""
    if B_FP8:
        if A_FP8:
            if B_SCALE_PER_TILE:
                acc += tl.dot(a, b) * (a_s * b_s)[:, None]
            else:
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            if B_SCALE_PER_TILE:
                acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * b_s
            else:
                acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * b_s[None, :]
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _moe_gemm_kernel(
    A,
    B,
    C,
    Sorted_ids,
    Expert_ids,
    Num_padded,
    Pair_weights,
    A_scale,
    B_scale,
    N,
    K,
    num_pairs,
    num_experts,
    a_rows_per_pair,
    num_m_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_asm,
    stride_bse,
    stride_bsn,
    stride_bsk,
    group_n,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    A_FP8: tl.constexpr,
    B_FP8: tl.constexpr,
    GROUP_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PAIR_PER_BLOCK: tl.constexpr,
    B_SCALE_PER_TILE: tl.constexpr,
):
    """C[pair, :N] = A[pair // a_rows_per_pair] @ B[expert].T for the pairs of each row block.
    GATED: B holds 2N rows (gate, then up) and C gets silu(gate) * up. WEIGHTED: rows are scaled by
    Pair_weights[pair]. B_FP8: B is fp8 with block scales B_scale [E, rows / bn, K / bk] (group_n = bn,
    GROUP_K = bk); A_FP8: A is fp8 too, with group scales A_scale [rows of A, K / bk].
    PAIR_PER_BLOCK: block m holds pair m alone, at row 0 (the other rows are padding), and Expert_ids is
    topk_ids flattened (any integer dtype); Sorted_ids and Num_padded are not read."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n_blocks
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    if PAIR_PER_BLOCK:
        in_use = pid_m < num_pairs  # the grid has one row block per pair: always
    else:
        in_use = pid_m * BLOCK_M < tl.load(Num_padded)
    if in_use:
        expert = tl.load(Expert_ids + pid_m).to(tl.int64)
        if PAIR_PER_BLOCK:
            tl.device_assert((expert >= 0) & (expert < num_experts), "expert id outside [0, E)")
            pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        else:
            pairs = tl.load(Sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        # Padding rows are masked (reading row 0 for them sent every program's padding to the same lines
        # of A: kernels/fp8_gemm.py's GEMM ran 1.4-2x slower so); columns past N read column 0 (never
        # stored); K's tail is masked only when K is not a multiple of BLOCK_K.
        a_rows = tl.where(valid, pairs // a_rows_per_pair, 0)
        safe_n = tl.where(n_mask, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        # Both tiles are addressed as a scalar base (advanced per step) plus loop-invariant int32 offsets
        # (the wrapper keeps A under 2^31 elements): tensors of 64-bit pointers, one per operand and one
        # for the up rows, held two registers per element through the loop and made the gated tiles spill.
        a_base = A
        a_offs = a_rows[:, None] * stride_am + offs_k[None, :]
        b_base = B + expert * stride_be
        b_offs = safe_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        a_scale_ptrs = A_scale + a_rows.to(tl.int64) * stride_asm
        if B_SCALE_PER_TILE:  # one weight block across the tile's columns: its scale, a scalar per K step
            b_scale_ptrs = B_scale + expert * stride_bse + ((pid_n * BLOCK_N) // group_n) * stride_bsn
            b_scale_up_ptrs = B_scale + expert * stride_bse + ((N + pid_n * BLOCK_N) // group_n) * stride_bsn
        else:
            b_scale_ptrs = B_scale + expert * stride_bse + (safe_n // group_n) * stride_bsn
            b_scale_up_ptrs = B_scale + expert * stride_bse + ((N + safe_n) // group_n) * stride_bsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_base + a_offs, mask=valid[:, None], other=0.0)
                b = tl.load(b_base + b_offs)
            else:
                k_mask = offs_k < K - k0
                a = tl.load(a_base + a_offs, mask=valid[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_base + b_offs, mask=k_mask[:, None], other=0.0)
            a_s = tl.load(a_scale_ptrs + k0 // GROUP_K, mask=valid, other=0.0) if A_FP8 else None
            b_s = tl.load(b_scale_ptrs + (k0 // GROUP_K) * stride_bsk) if B_FP8 else None
            acc = _accumulate(acc, a, b, a_s, b_s, A_FP8, B_FP8, DOT_PRECISION, B_SCALE_PER_TILE)
            if GATED:
                if EVEN_K:
                    b_up = tl.load(b_base + N * stride_bn + b_offs)
                else:
                    b_up = tl.load(b_base + N * stride_bn + b_offs, mask=k_mask[:, None], other=0.0)
                if B_FP8:
                    b_s = tl.load(b_scale_up_ptrs + (k0 // GROUP_K) * stride_bsk)
                acc_up = _accumulate(acc_up, a, b_up, a_s, b_s, A_FP8, B_FP8, DOT_PRECISION, B_SCALE_PER_TILE)
            a_base += BLOCK_K
            b_base += BLOCK_K * stride_bk
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
    b_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] = (1, 1),
    quantize_a: bool = False,
    pair_per_block: bool = False,
) -> None:
    """One grouped GEMM; with b_scale, b is fp8 in block_size blocks, and quantize_a quantizes a first
    (per token, groups of bk) for the fp8 x fp8 product. pair_per_block: one row block per pair, the
    expert of each in expert_ids (topk_ids flattened); sorted_ids and num_padded are then unused."""
    a_scale = None
    if quantize_a:
        a, a_scale = per_token_group_quant_fp8(a, block_size[1])
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
        a_scale if a_scale is not None else c,
        b_scale if b_scale is not None else c,
        n,
        a.shape[1],
        c.shape[0],
        b.shape[0],
        a_rows_per_pair,
        num_m_blocks,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        a_scale.stride(0) if a_scale is not None else 0,
        b_scale.stride(0) if b_scale is not None else 0,
        b_scale.stride(1) if b_scale is not None else 0,
        b_scale.stride(2) if b_scale is not None else 0,
        block_size[0],
        GATED=gated,
        WEIGHTED=pair_weights is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        DOT_PRECISION=dot_precision(a.dtype),
        A_FP8=a_scale is not None,
        B_FP8=b_scale is not None,
        GROUP_K=block_size[1],
        EVEN_K=a.shape[1] % tiles.block_k == 0,
        PAIR_PER_BLOCK=pair_per_block,
        # The up rows start at N: they too lie in one block per tile only if bn divides N as well.
        B_SCALE_PER_TILE=b_scale is not None and block_size[0] % tiles.block_n == 0 and n % block_size[0] == 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _check_fp8_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None,
    w2_scale_inv: torch.Tensor | None,
    block_size: tuple[int, int] | None,
) -> tuple[int, int] | None:
    """(bn, bk) for block-FP8 experts, None for unquantized ones; a ValueError for a mix."""
    given = [x is not None for x in (w13_scale_inv, w2_scale_inv, block_size)]
    if not any(given):
        if FP8_DTYPE in (w13.dtype, w2.dtype):
            raise ValueError("float8_e4m3fn experts need w13_scale_inv, w2_scale_inv and block_size")
        return None
    if not all(given):
        raise ValueError("FP8 experts take w13_scale_inv, w2_scale_inv and block_size together")
    if len(block_size) != 2 or not all(isinstance(v, int) and v > 0 for v in block_size):
        raise ValueError(f"block_size must be two positive integers (bn, bk), got {block_size!r}")
    bn, bk = block_size
    for name, w, scale in (("w13", w13, w13_scale_inv), ("w2", w2, w2_scale_inv)):
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be float8_e4m3fn when scales are given, got {w.dtype}")
        expected = (w.shape[0], triton.cdiv(w.shape[1], bn), triton.cdiv(w.shape[2], bk))
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}_scale_inv must be float32 {list(expected)} for {name} {list(w.shape)} in "
                f"{list(block_size)} blocks, got {list(scale.shape)} {scale.dtype}"
            )
    return bn, bk


@triton.jit
def _combine_kernel(P, Out, Shared, Gate, H, stride_st, stride_gt, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Out[t] = sum_j P[t, j] (float32, j = 0, 1, ... in order) [+ sigmoid(Gate[t]) * Shared[t]], rounded once."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(P + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        gate = tl.load(Gate + t * stride_gt).to(tl.float32)
        shared = tl.load(Shared + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        acc += shared * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(Out + t * H + cols, acc.to(Out.dtype.element_ty), mask=mask)


def combine_experts(
    per_pair: torch.Tensor, top_k: int, shared: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """per_pair [T * k, H] (each token's k weighted expert outputs, contiguous) -> [T, H]: their sum, plus
    sigmoid(gate) * shared_out where shared = (shared_out [T, H], gate [T, 1]) is given (Qwen3.5's gated
    shared expert), in one launch: what torch's sum over k, sigmoid, product and add took four for."""
    hidden_size = per_pair.shape[1]
    num_tokens = per_pair.shape[0] // top_k
    out = torch.empty((num_tokens, hidden_size), dtype=per_pair.dtype, device=per_pair.device)
    if num_tokens == 0:
        return out
    shared_out, gate = shared if shared is not None else (out, out)
    if shared is not None and (
        shared_out.shape != (num_tokens, hidden_size) or shared_out.stride(1) != 1
        or gate.shape != (num_tokens, 1)
    ):  # fmt: skip
        raise ValueError(
            f"shared: expected shared_out [{num_tokens}, {hidden_size}] (contiguous rows) and gate "
            f"[{num_tokens}, 1], got {tuple(shared_out.shape)} and {tuple(gate.shape)}"
        )
    block = min(1024, triton.next_power_of_2(hidden_size))
    pdl = launch_options(per_pair.device)
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        per_pair, out, shared_out, gate, hidden_size, shared_out.stride(0), gate.stride(0),
        TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK=block, PDL=pdl_mode(pdl), **pdl,
    )  # fmt: skip
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | None = None,
    sum_in_order: bool = False,
    *,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    fp8_activations: bool | None = None,
    pair_per_block: bool | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * w2[e_j] @ silu_and_mul(w13[e_j] @ x) for each token x, plus
    sigmoid(gate) * shared_out where shared = (shared_out [T, H], gate [T, 1]) is given (added in the
    launch that sums the k outputs: combine_experts).
    sum_in_order: add the k expert outputs j = 0, 1, ... one after another (deterministic inference: a
    reduction kernel over k may split it differently for another number of tokens).

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights, topk_ids [T, k].
    Same contract as services.worker.runtime.layers.moe.moe_forward; returns [T, H] in hidden's dtype.
    Block-FP8 experts: w13 / w2 float8_e4m3fn with w13_scale_inv [E, ceil(2I/bn), ceil(H/bk)] and
    w2_scale_inv [E, ceil(H/bn), ceil(I/bk)], block_size (bn, bk); fp8_activations picks w8a8 (True,
    the default) or weight-only (False). pair_per_block: give every (token, expert)
    pair a row block of its own instead of sorting the pairs by expert (the same result, bit for bit),
    by default for decode-sized batches (moe_blocks.one_pair_per_block).
    topk_ids: int32 or int64 in [0, E) (moe_blocks.check_expert_ids says what is checked where).
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
    fp8_block = _check_fp8_experts(w13, w2, w13_scale_inv, w2_scale_inv, block_size)
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if max(hidden.numel(), num_pairs * inter) >= 2**31:
        raise ValueError(f"{num_tokens} tokens are too many for one call (int32 offsets): split the batch")
    check_expert_ids(topk_ids, num_experts)
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    tiles = tiles or moe_tiles_for(num_pairs, num_experts, fp8=fp8_block is not None)
    quantize = False
    if fp8_block is None and fp8_activations is not None:
        raise ValueError("fp8_activations applies to FP8 experts only (pass their scales and block_size)")
    if fp8_block is not None:
        block_k = pow2_divisor(fp8_block[1], tiles.block_k)
        if block_k < 16:
            raise ValueError(f"block_size[1] = {fp8_block[1]} must be a multiple of 16 for the expert GEMMs")
        tiles = replace(tiles, block_k=block_k)
        quantize = True if fp8_activations is None else fp8_activations
    if pair_per_block is None:
        pair_per_block = one_pair_per_block(num_tokens, top_k, num_experts)
    fp8 = dict(block_size=fp8_block or (1, 1), quantize_a=quantize, pair_per_block=pair_per_block)
    if pair_per_block:
        # Block p is pair p's: its expert is topk_ids' entry p, read in the kernel (no launch, no cast).
        expert_ids = topk_ids.reshape(-1).contiguous()
        sorted_ids = num_padded = expert_ids
    else:
        sorted_ids, expert_ids, num_padded = align_tokens_by_expert(topk_ids, num_experts, tiles.block_m)
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(
        hidden, w13, act, sorted_ids, expert_ids, num_padded, None, top_k, True, tiles, w13_scale_inv, **fp8
    )
    per_pair = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(
        act, w2, per_pair, sorted_ids, expert_ids, num_padded, weights, 1, False, tiles, w2_scale_inv, **fp8
    )
    if not sum_in_order:
        return per_pair if top_k == 1 and shared is None else combine_experts(per_pair, top_k, shared)
    per_token = per_pair.view(num_tokens, top_k, hidden_size)
    out = per_token[:, 0].clone()
    for j in range(1, top_k):
        out += per_token[:, j]
    if shared is not None:
        out = out + torch.sigmoid(shared[1]) * shared[0]
    return out
