"""A batch-invariant matrix product for --enable-deterministic-inference: y = x W^T with one launch shape.

Why the usual products are not batch-invariant: cuBLAS (and kernels/gemv.py, which takes one row or up
to 16) picks its tiles, its instruction and whether to split K from the number of rows M, so the same row
is summed in a different order alone than among 63 others, and bf16 rounding turns that into different
tokens a few hundred steps later ("Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025).

This kernel has one launch shape per weight shape (N, K) whatever M is: fixed BLOCK_M x BLOCK_N output
tiles, K cut into SPLIT_K fixed ranges each walked in BLOCK_K steps in order, float32 accumulation, and
the ranges' parts added in split order by the tile's last program (kernels/split_reduce.py). An output
element is then the same sequence of tl.dot accumulations over the same K tiles, and the same sum of the
same parts, whichever tile its row lands in and whatever the other rows hold (a tensor-core product
never mixes rows), so a row's result does not depend on the batch. `tiles_for` picks the shape by (N, K)
alone: narrower tiles and a split over K where N is small (a 0.6B model's o_proj and down_proj have N =
1024: 8 tiles of 128 columns for 132 SMs at a decode batch), the Hopper warpgroup tile (64 x 128)
elsewhere. The price is the tile that suits a large M: a decode step of a few rows still computes
BLOCK_M rows per tile.

The split is arithmetic, not scheduling: a row's value is the sum, in split order, of the K ranges' parts,
each walked from zero. Where a launch has programs enough without it (a prefill chunk: FILL_PROGRAMS
output tiles or more), one program walks its tile's ranges one after another and adds each part as it
finishes, the same float32 additions in the same order as the split launch's last program makes from the
workspace, with no workspace, tickets or second pass; a decode step spreads the ranges over programs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.split_reduce import check_tiles, split_workspace, store_split, ticket_counters


@dataclass(frozen=True)
class MatmulTiles:
    """The one launch shape. The default is a Hopper warpgroup tile (64 x 128 over 4 warps)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


DEFAULT_TILES = MatmulTiles()
# From this many rows a launch takes tiles of 128 rows instead of 64 (same columns, K walk and split): each row
# is still the same sequence of the same warpgroup instruction over the same K tiles, so the bits are those of
# 64-row tiles (checked on the H200 for Qwen3-8B's and 0.6B's shapes at M = 256, 2,048 and 8,192:
# bench/gpu_deterministic.py's `block_m_equal`), and a prefill chunk's products take 15-20 % less time
# (0.6B's down_proj at M = 256: 26.0 -> 16.2 us, its split then spread over the grid).
WIDE_ROWS = 256
# Programs a decode-sized launch (one row tile) should reach before K is split, and the fewest columns of
# K a split keeps.
FILL_PROGRAMS = 64
MIN_SPLIT_COLUMNS = 512


def tiles_for(n: int, k: int) -> MatmulTiles:
    """The launch shape of a weight [N, K], the same for every M: 128 columns per tile, or 64 where one
    row of tiles would have fewer than FILL_PROGRAMS programs, then K split (at most 8 ways, MIN_SPLIT_COLUMNS
    each) for what is still short."""
    block_n = 128
    while block_n > 64 and triton.cdiv(n, block_n) < FILL_PROGRAMS:
        block_n //= 2
    tiles_n = triton.cdiv(n, block_n)
    split = 1
    while split < 8 and tiles_n * split < FILL_PROGRAMS and k // (2 * split) >= MIN_SPLIT_COLUMNS:
        split *= 2
    return MatmulTiles(block_n=block_n, split_k=split)


@triton.jit
def _walk_k(X, W, rows, row_mask, safe_cols, k_start, k_per_split, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The float32 [BLOCK_M, BLOCK_N] product of one K range, [k_start, k_start + k_per_split) cut at K,
    walked from zero in BLOCK_K steps. Rows outside row_mask load zeros (no memory traffic; each output
    row depends on its own row only, so valid rows are the same bits either way)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + safe_cols[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k0 + tl.arange(0, BLOCK_K)) < k_end
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


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
    Work,
    Tickets,
    k_per_split,
    SPLIT: tl.constexpr,
    SPLITS_IN_PROGRAM: tl.constexpr,
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
    # Rows past M are masked (reading row 0 for them sent every program's padding to the same lines of X:
    # kernels/fp8_gemm.py's GEMM ran 1.4-2x slower so); columns past N read column 0, never stored.
    row_mask = rows < M
    safe_rows = rows.to(tl.int64)
    safe_cols = tl.where(cols < N, cols, 0).to(tl.int64)
    if SPLITS_IN_PROGRAM > 1:
        # The split launch's arithmetic in one program: each range from zero, the parts added in order.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SPLITS_IN_PROGRAM):
            acc += _walk_k(X, W, safe_rows, row_mask, safe_cols, s * k_per_split, k_per_split, K, stride_xm, stride_wn,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)  # fmt: skip
    else:
        acc = _walk_k(X, W, safe_rows, row_mask, safe_cols, tl.program_id(1) * k_per_split, k_per_split, K, stride_xm,
                      stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)  # fmt: skip
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out_offs = rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    part_offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    store_split(acc, Y, out_offs, Work, part_offs, M * N, Tickets, pid, tl.program_id(1), mask, SPLIT)


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: MatmulTiles | None = None,
    splits_in_program: bool | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for x [..., K] and weight [N, K] (rows of both contiguous along K), in x's dtype,
    with `tiles` (default: tiles_for(N, K), in 128-row tiles from WIDE_ROWS rows). Each output row
    depends only on its own input row: the same bits alone or in any batch. A split over K is walked by one program where the launch has
    FILL_PROGRAMS output tiles or more, by a program per range below (`splits_in_program` forces either)."""
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
        if tiles is None:
            tiles = tiles_for(n, k)
            if m >= WIDE_ROWS:
                tiles = replace(tiles, block_m=128)
        if tiles.split_k < 1:
            raise ValueError(f"split_k must be at least 1, got {tiles.split_k}")
        # Each split a whole number of BLOCK_K steps, so a split's K tiles are the unsplit walk's.
        k_per_split = triton.cdiv(triton.cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
        split = triton.cdiv(k, k_per_split)
        out_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
        in_program = split if (out_tiles >= FILL_PROGRAMS if splits_in_program is None else splits_in_program) else 1
        grid_split = 1 if in_program > 1 else split
        if grid_split > 1:
            check_tiles(out_tiles)
        _matmul_kernel[(out_tiles, grid_split)](
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
            Work=split_workspace(grid_split, m * n, y),
            Tickets=ticket_counters(x.device),
            k_per_split=k_per_split,
            SPLIT=grid_split,
            SPLITS_IN_PROGRAM=in_program,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)
