"""Weight-only block-FP8 products for few rows (batch-1 and small-batch decode): the fp8 weight is read once
and dequantized in registers, the activations stay in their own dtype, and the step is bound by the
weight's bytes, which FP8 halves against bf16.

One row ("rows" tiles, as kernels/gemv.py): each program owns BLOCK_N output rows, all inside one row of
block scales (BLOCK_N divides bn), and streams them across K; each thread sums its 16-column chunks in
registers as they arrive and the cross-thread reduction happens once at the end. The block scales are
folded into the row instead of the weight, x * scale[k // bk], a [BLOCK_K] vector per tile shared by all
BLOCK_N rows, so each weight element costs one conversion and one FMA, as in the bf16 GEMV. It has the
bf16 GEMV's two prologues (kernels/gemv.py's jit helpers, the same rounding): `fp8_rmsnorm_gemv` (residual
add and RMSNorm before the projection, the sum written back) and `fp8_silu_mul_gemv` (SiLU-and-mul of the
gate_up output before down_proj), one launch each instead of the elementwise kernel and the product.

Up to 16 rows ("dot" tiles): the same weight tiles go through tl.dot with the rows padded to 16, the fp8
weight converted to the activation dtype exactly (e4m3 fits in bf16/f16); BLOCK_K divides bk, so each
tile's partial product is scaled by its one block scale before it joins the float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.fp8_reference import ACTIVATION_DTYPES, check_block_weight
from kernels.gemv import (
    DOT_MAX_ROWS,
    GemvTiles,
    check_prologue_row,
    prologue_input,
    rmsnorm_outputs,
    rmsnorm_rstd,
)

GEMV_MAX_ROWS = DOT_MAX_ROWS
GEMV_DOT_TILES = GemvTiles(block_n=32, block_k=128, num_warps=4, num_stages=4, kind="dot")


def fp8_gemv_tiles_for(n: int, k: int) -> GemvTiles:
    """One-row tiles by shape: 8 KB of weight per program and step (8 x 1024 fp8) where N is a hidden
    size, so a 4096-row weight still makes 512 programs (about four per SM, ~32 KB of loads in flight
    each); 16 rows where N is wide enough to fill the machine anyway. bench/gpu_fp8.py sweeps others."""
    return GemvTiles(
        block_n=8 if n <= 8192 else 16, block_k=1024 if k >= 1024 else 512, num_warps=4, num_stages=3
    )


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    return min(n & -n, cap)


@triton.jit
def _fp8_gemv_rows_kernel(
    X,
    W,
    W_scale,
    Y,
    N,
    K,
    stride_wn,
    stride_wsn,
    group_n,
    Residual,
    Norm_w,
    Res_out,
    eps,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    EVEN_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
):
    """The row is kernels/gemv.py's prologue_input: X (PROLOGUE 0), rmsnorm(X (+ Residual)) with program 0
    writing X + Residual to Res_out (1), silu(gate) * up of X = [gate | up] (2)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_rows = tl.where(rows < N, rows, 0).to(tl.int64)
    # BLOCK_N divides bn: every row of this program has the same row of block scales.
    scale_row = W_scale + ((pid * BLOCK_N) // group_n).to(tl.int64) * stride_wsn
    rstd = rmsnorm_rstd(X, Residual, Res_out, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_FULL)
    # A K tile is BLOCK_K / VEC chunks of VEC contiguous columns (one 16-byte load of fp8 per row), each
    # inside one scale block. Each chunk's products are summed in registers as it arrives, so the
    # partial sums are [BLOCK_N, BLOCK_K / VEC]: half the registers of a [BLOCK_N, BLOCK_K] sum at
    # 16 x 512 (64 against 128 for sm90, per ptxas), so twice the programs and loads in flight per SM.
    chunks = tl.arange(0, BLOCK_K // VEC)
    offs = chunks[:, None] * VEC + tl.arange(0, VEC)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs
        w_ptrs = W + safe_rows[:, None, None] * stride_wn + cols[None, :, :]
        scale_ptrs = scale_row + (k0 + chunks * VEC) // GROUP_K
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = prologue_input(X, Residual, Norm_w, cols, K, rstd, PROLOGUE, HAS_RESIDUAL, EVEN_K)
            x = x * tl.load(scale_ptrs)[:, None]
        else:
            w = tl.load(w_ptrs, mask=(cols < K)[None, :, :], other=0.0, eviction_policy="evict_first")
            x = prologue_input(X, Residual, Norm_w, cols, K, rstd, PROLOGUE, HAS_RESIDUAL, EVEN_K)
            x = x * tl.load(scale_ptrs, mask=k0 + chunks * VEC < K, other=0.0)[:, None]
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)
    tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=rows < N)


@triton.jit
def _fp8_gemv_dot_kernel(
    X,
    W,
    W_scale,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ym,
    group_n,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    # BLOCK_N divides bn and BLOCK_K divides bk: one block scale per weight tile.
    scale_row = W_scale + ((pid * BLOCK_N) // group_n).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(W + safe_n[None, :] * stride_wn + offs_k[:, None], eviction_policy="evict_first")
        else:
            k_mask = offs_k < K
            x = tl.load(
                X + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                W + safe_n[None, :] * stride_wn + offs_k[:, None],
                mask=k_mask[:, None],
                other=0.0,
                eviction_policy="evict_first",
            )
        part = tl.dot(x, w.to(X.dtype.element_ty), input_precision=DOT_PRECISION)
        acc += part * tl.load(scale_row + k0 // GROUP_K)
    tl.store(
        Y + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(Y.dtype.element_ty),
        mask=m_mask[:, None] & (offs_n < N)[None, :],
    )


def fp8_block_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """Weight-only for few rows (batch-1 decode): x [M<=GEMV_MAX_ROWS, K] bf16/f16/f32, the fp8 weight
    dequantized inside the kernel; memory-bound on the fp8 weight bytes. Returns [M, N] in x.dtype.
    `tiles` (kernels/gemv.GemvTiles): "rows" takes one row, "dot" up to 16; default by M."""
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    bn, bk = block_size
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.shape[1] != k:
        raise ValueError(f"x must be bfloat16/float16/float32 [M, {k}], got {tuple(x.shape)} {x.dtype}")
    m = x.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"fp8_block_gemv takes 1 to {GEMV_MAX_ROWS} rows, got {m}")
    tiles = tiles or (fp8_gemv_tiles_for(n, k) if m == 1 else GEMV_DOT_TILES)
    if tiles.kind == "rows" and m != 1:
        raise ValueError(f"'rows' tiles take one row, got {m}; use 'dot' tiles for up to {GEMV_MAX_ROWS}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = pow2_divisor(bn, tiles.block_n)
    if tiles.kind == "rows":
        _launch_rows(x, w_q, w_scale_inv, block_size, out, tiles)
        return out
    block_k = pow2_divisor(bk, tiles.block_k)
    if block_k < 16:
        raise ValueError(f"block_size[1] = {bk} must be a multiple of 16 for 'dot' tiles")
    _fp8_gemv_dot_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_scale_inv,
        out,
        m,
        n,
        k,
        x.stride(0),
        w_q.stride(0),
        w_scale_inv.stride(0),
        out.stride(0),
        bn,
        GROUP_K=bk,
        BLOCK_M=DOT_MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def _launch_rows(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    out: torch.Tensor,
    tiles: GemvTiles,
    prologue: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    n, k = w_q.shape
    bn, bk = block_size
    block_n = pow2_divisor(bn, tiles.block_n)
    _fp8_gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        w_q,
        w_scale_inv,
        out,
        n,
        k,
        w_q.stride(0),
        w_scale_inv.stride(0),
        bn,
        x if residual is None else residual,
        x if norm_weight is None else norm_weight,
        x if residual_out is None else residual_out,
        eps,
        GROUP_K=bk,
        BLOCK_N=block_n,
        BLOCK_K=tiles.block_k,
        VEC=min(pow2_divisor(bk, 16), tiles.block_k),
        EVEN_K=k % tiles.block_k == 0,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        BLOCK_FULL=triton.next_power_of_2(k) if prologue == 1 else 1,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _check_prologue_operands(
    x: torch.Tensor,
    features: int,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    tiles: GemvTiles | None,
    name: str,
) -> tuple[int, GemvTiles]:
    """(N, the tiles) of a fused one-row product, or a ValueError."""
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16/float16/float32, got {x.dtype}")
    tiles = tiles or fp8_gemv_tiles_for(n, k)
    check_prologue_row(x, features * k, tiles, name)
    return n, tiles


def fp8_rmsnorm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: GemvTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/gemv.py's rmsnorm_gemv with the block-FP8 weight: (rmsnorm(x + residual) W^T, x + residual)
    for one row x [1, K] in one launch, the norm rounded as kernels/rmsnorm.py rounds it. Without a
    residual the norm is of x alone and x itself is returned as the residual."""
    n, tiles = _check_prologue_operands(x, 1, w_q, w_scale_inv, block_size, tiles, "fp8_rmsnorm_gemv")
    out, residual_out = rmsnorm_outputs(x, residual, norm_weight, n)
    _launch_rows(x, w_q, w_scale_inv, block_size, out, tiles, prologue=1, residual=residual,
                 norm_weight=norm_weight, residual_out=residual_out if residual is not None else None,
                 eps=eps)  # fmt: skip
    return out, residual_out


def fp8_silu_mul_gemv(
    gate_up: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """kernels/gemv.py's silu_mul_gemv with the block-FP8 weight: (silu(gate) * up) W^T for one row
    gate_up [1, 2K] (gate columns then up columns) in one launch."""
    n, tiles = _check_prologue_operands(gate_up, 2, w_q, w_scale_inv, block_size, tiles, "fp8_silu_mul_gemv")
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _launch_rows(gate_up, w_q, w_scale_inv, block_size, out, tiles, prologue=2)
    return out
