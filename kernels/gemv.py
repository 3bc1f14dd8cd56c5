"""Matrix-vector product for batch-1 decode: y = W x for one row x, reading W exactly once.

At batch 1 every linear layer is a matrix-vector product bound by reading the weight, and a decode step
of an 8B model is ~250 such reads back to back. A program owns BLOCK_N output rows and streams them
across K in BLOCK_K-wide tiles, keeping a [BLOCK_N, BLOCK_K] float32 partial sum that is reduced once at
the end (one cross-lane reduction per program instead of one per tile). There is no split over K: at
the shapes of a decode step (N >= 1024) the row blocks alone give several programs per SM, and a split
would need a second pass or float32 atomics to combine.

The weight is loaded with `evict_first`: it is read once per step and should not push the KV and
activations out of L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvTiles:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    # Out-of-range rows read row 0 instead of masking every load; their sums are never stored.
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + cols)
            w = tl.load(W + safe_rows[:, None] * stride_wn + cols[None, :], eviction_policy="evict_first")
        else:
            col_mask = cols < K
            x = tl.load(X + cols, mask=col_mask, other=0.0)
            w = tl.load(
                W + safe_rows[:, None] * stride_wn + cols[None, :],
                mask=col_mask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) times weight [N, K]^T -> [1, N] (or [N]), in x's dtype, float32 accumulation."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be 2-D with contiguous rows, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    n, k = weight.shape
    if x.numel() != k or (x.dim() == 2 and x.shape[0] != 1) or x.dim() > 2:
        raise ValueError(f"x must be one row of {k} features, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    x_flat = x.reshape(k)
    if x_flat.stride(0) != 1:
        x_flat = x_flat.contiguous()
    if out is None:
        out = torch.empty(n, dtype=x.dtype, device=x.device)
    elif out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with {n} elements, got {tuple(out.shape)}")
    tiles = tiles or GemvTiles()
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x_flat,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out.view(x.shape[:-1] + (n,)) if x.dim() == 2 else out.view(n)
