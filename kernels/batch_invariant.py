"""A batch-invariant matrix product for --enable-deterministic-inference: y = x W^T with one launch shape.

Why the usual products are not batch-invariant: cuBLAS (and kernels/gemv.py, which takes one row or up
to 16) picks its tiles, its instruction and whether to split K from the number of rows M, so the same row
is summed in a different order alone than among 63 others, and bf16 rounding turns that into different
tokens a few hundred steps later ("Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025).

This kernel has one launch shape whatever M is: fixed BLOCK_M x BLOCK_N output tiles, K walked in
BLOCK_K steps from 0 to K in order, float32 accumulation, no split over K. An output element is then the
same sequence of tl.dot accumulations over the same K tiles whichever tile its row lands in and whatever
the other rows hold (a tensor-core product never mixes rows), so a row's result does not depend on the
batch. The price is the tile that suits a large M: a decode step of a few rows still computes BLOCK_M
rows per tile, and there is no split-K to fill the GPU when M x N is small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision


@dataclass(frozen=True)
class MatmulTiles:
    """The one launch shape. The default is a Hopper warpgroup tile (64 x 128 over 4 warps)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILES = MatmulTiles()


@triton.jit
def _matmul_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped order: GROUP_M row blocks share a column block's weight tiles in L2. The order decides
    # only which program runs when, never what a program computes.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns read row / column 0; their results are never stored.
    safe_rows = tl.where(rows < M, rows, 0).to(tl.int64)
    safe_cols = tl.where(cols < N, cols, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + safe_rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + safe_cols[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        Y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask
    )


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: MatmulTiles = DEFAULT_TILES,
) -> torch.Tensor:
    """x W^T (+ bias) for x [..., K] and weight [N, K] (rows of both contiguous along K), in x's dtype.
    Each output row depends only on its own input row: the same bits alone or in any batch."""
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}] for inputs of {k} features, got {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if weight.stride(1) != 1:
        raise ValueError("weight: the K axis must be contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > 0 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
        _matmul_kernel[grid](
            x2,
            weight,
            y,
            m,
            n,
            k,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            GROUP_M=tiles.group_m,
            EVEN_K=k % tiles.block_k == 0,
            DOT_PRECISION=dot_precision(x.dtype),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)
