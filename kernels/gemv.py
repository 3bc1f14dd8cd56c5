"""Matrix-vector product for batch-1 decode: y = W x for one row x, reading W exactly once.

At batch 1 every linear layer is a matrix-vector product bound by reading the weight, and a decode step
of an 8B model is ~250 such reads back to back. A program owns BLOCK_N output rows and streams them
across K in BLOCK_K-wide tiles, keeping a [BLOCK_N, BLOCK_K] float32 partial sum that is reduced once at
the end (one cross-lane reduction per program instead of one per tile). At most shapes of a decode step
the row blocks alone give several programs per SM; a narrow product (Qwen3-0.6B's o_proj and down_proj,
N = 1,024, 64 programs of 16 rows) can split K too (`GemvTiles.split`): each program writes its part and
the last of a row block adds the parts in split order in the same launch (kernels/split_reduce.py).

Two prologues fold the elementwise kernel before a projection into it (batch-1 decode is bound by
launches as much as by bytes: a 0.6B step is ~250 kernels): `rmsnorm_gemv` normalizes the row (adding
the residual first) as it is read, `silu_mul_gemv` forms silu(gate) * up from the gate_up output. The
prologues are the jit helpers `rmsnorm_rstd` and `prologue_input`, which kernels/fp8_gemv.py's one-row
FP8 GEMV shares.

The weight is loaded with `evict_first`: it is read once per step and should not push the KV and
activations out of L2.

A second form (`GemvTiles(kind="dot")`) takes up to 16 rows (speculative verification, small batches):
the rows are padded to 16 and each weight tile goes through `tl.dot` on the tensor cores, still reading
W once. Every row's products are computed the same way whatever the other rows are (a row's output
depends only on its own inputs and the tiles), so one row alone and the same row among k others get the
same bits: a speculative step's verification logits equal plain decoding's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter, pdl_mode, preload_weights
from kernels.split_reduce import check_tiles, split_workspace, store_split, ticket_counters

# Rows the "dot" form takes (the padded M of its tensor-core products).
DOT_MAX_ROWS = 16
# Only products of at most this many weight bytes read ahead. On the H200 (bench/gpu_pdl.py --env
# RS_PDL_PRELOAD, 2026-12-04) reading ahead made Qwen3-0.6B's batch-1 decode 1.07-1.10x faster (every
# product <= 12.6 MB, one wave of short programs) and Qwen3-8B's 0.96x (products of 34-201 MB in several
# waves of long programs, where the early programs hold their registers through the wait while the
# product before still has waves to run).
PRELOAD_MAX_WEIGHT_BYTES = 16 << 20
# RS_PDL_PRELOAD_SLICE=1: a launch reads up to three tiles ahead (the whole row slice where K fits), not
# one (A/B runs; with RS_PDL_EARLY_RELEASE several kernels ahead may be reading).
PRELOAD_SLICE_ENV = "RS_PDL_PRELOAD_SLICE"
PRELOAD_SLICE_TILES = 3


@dataclass(frozen=True)
class GemvTiles:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2
    kind: str = "rows"  # "rows": one row, float32 partial sums per element; "dot": up to 16 rows, tl.dot
    # "rows" only: K split across this many programs a row block, their parts added in split order by the
    # last of them (kernels/split_reduce.py), for narrow products whose row blocks alone leave SMs idle.
    split: int = 1

    @property
    def max_rows(self) -> int:
        return DOT_MAX_ROWS if self.kind == "dot" else 1

    def fits(self, k: int) -> bool:
        """Whether a launch over K = k can take these tiles: a split covers a whole number of K tiles."""
        return self.split == 1 or (self.kind == "rows" and k % (self.split * self.block_k) == 0)


@triton.jit
def rmsnorm_rstd(X, Residual, Res_out, K, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_FULL: tl.constexpr):
    """1 / rms of the row X (+ Residual) over its K features where PROLOGUE is 1 (else 1.0). With a
    residual the sum is rounded to X's dtype, as kernels/rmsnorm.py rounds it, and program 0 writes it to
    Res_out. Every program needs the whole row's statistics before its first tile: K is a hidden size (a
    few thousand), so one extra read of it from L2 per program (BLOCK_FULL >= K).

    (A one-pass norm, gathering the sum of squares with the tiles and scaling the finished dot products
    by 1/rms, was slower on the H200: the extra loads per tile cost more than the wait it saves.)"""
    rstd = 1.0
    if PROLOGUE == 1:
        dtype = X.dtype.element_ty
        full = tl.arange(0, BLOCK_FULL)
        full_mask = full < K
        h = tl.load(X + full, mask=full_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = (h + tl.load(Residual + full, mask=full_mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(Res_out + full, h, mask=full_mask & (tl.program_id(0) == 0))
            h = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    return rstd


@triton.jit
def prologue_input(X, Residual, Norm_w, cols, K, rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """The product's input at columns `cols` (a tensor of any shape; those >= K read 0), in float32.
    PROLOGUE 0: X. 1: rmsnorm(X (+ Residual)) with weight Norm_w and the row's rstd (rmsnorm_rstd).
    2: X holds [gate | up] of 2K features and the input is silu(gate) * up. Each rounded to X's dtype
    where the unfused kernels (kernels/rmsnorm.py, kernels/activation.py) round."""
    dtype = X.dtype.element_ty
    col_mask = cols < K
    if PROLOGUE == 0:
        if EVEN_K:
            x = tl.load(X + cols).to(tl.float32)
        else:
            x = tl.load(X + cols, mask=col_mask, other=0.0).to(tl.float32)
    elif PROLOGUE == 1:
        # The rounding of kernels/rmsnorm.py: the sum, then x * rstd, then the product with the norm's
        # weight each rounded to the activation dtype.
        x = tl.load(X + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(Residual + cols, mask=col_mask, other=0.0).to(tl.float32)
            x = x.to(dtype).to(tl.float32)
        nw = tl.load(Norm_w + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = ((x * rstd).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
    else:
        gate = tl.load(X + cols, mask=col_mask, other=0.0).to(tl.float32)
        up = tl.load(X + K + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
    return x


@triton.jit
def _weight_tile(W, safe_rows, stride_wn, cols, K, EVEN_K: tl.constexpr):
    """W's [rows, cols] tile (columns >= K read 0), loaded evict_first."""
    if EVEN_K:
        w = tl.load(W + safe_rows[:, None] * stride_wn + cols[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(W + safe_rows[:, None] * stride_wn + cols[None, :], mask=(cols < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    return w


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    N,
    K,
    stride_wn,
    Residual,
    Norm_w,
    Res_out,
    eps,
    Work,
    Tickets,
    k_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """x is prologue_input's: X itself (PROLOGUE 0), rmsnorm(X (+ Residual)) with program 0 writing
    X + Residual to Res_out (1), silu(gate) * up of X = [gate | up] (2). With SPLIT > 1, program (i, s)
    takes columns s * k_per_split .. (s + 1) * k_per_split (a whole number of tiles; EVEN_K) of row block i."""
    pid = tl.program_id(0)
    k_start = tl.program_id(1) * k_per_split if SPLIT > 1 else 0
    k_end = k_start + k_per_split if SPLIT > 1 else K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    # Out-of-range rows read row 0 instead of masking every load; their sums are never stored.
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    # The weight is never written during a step, so its first tile may be read before the wait: the loads
    # are in flight while the kernel before this one finishes (pdl.py's protocol bars only activations
    # before the wait). Summed below in the loop's order.
    # PRELOAD is how many tiles (1 to 3; 0: none), the whole slice where K fits.
    if PRELOAD:
        w_first = _weight_tile(W, safe_rows, stride_wn, k_start + tl.arange(0, BLOCK_K), K, EVEN_K)
    if PRELOAD >= 2:
        w_second = _weight_tile(W, safe_rows, stride_wn, k_start + BLOCK_K + tl.arange(0, BLOCK_K), K, EVEN_K)
    if PRELOAD >= 3:
        w_third = _weight_tile(W, safe_rows, stride_wn, k_start + 2 * BLOCK_K + tl.arange(0, BLOCK_K), K, EVEN_K)
    pdl_enter(PDL)
    rstd = rmsnorm_rstd(X, Residual, Res_out, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_FULL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRELOAD:
        x = prologue_input(X, Residual, Norm_w, k_start + tl.arange(0, BLOCK_K), K, rstd, PROLOGUE, HAS_RESIDUAL,
                           EVEN_K)
        acc += w_first.to(tl.float32) * x[None, :]
    if PRELOAD >= 2:
        x = prologue_input(X, Residual, Norm_w, k_start + BLOCK_K + tl.arange(0, BLOCK_K), K, rstd, PROLOGUE,
                           HAS_RESIDUAL, EVEN_K)
        acc += w_second.to(tl.float32) * x[None, :]
    if PRELOAD >= 3:
        x = prologue_input(X, Residual, Norm_w, k_start + 2 * BLOCK_K + tl.arange(0, BLOCK_K), K, rstd, PROLOGUE,
                           HAS_RESIDUAL, EVEN_K)
        acc += w_third.to(tl.float32) * x[None, :]
    for k0 in range(k_start + PRELOAD * BLOCK_K, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(W, safe_rows, stride_wn, cols, K, EVEN_K)
        x = prologue_input(X, Residual, Norm_w, cols, K, rstd, PROLOGUE, HAS_RESIDUAL, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        # Rounded to the activation dtype whatever Y holds: a float32 Y (the LM head writing a CUDA graph's
        # logits buffer) gets the values a bfloat16 result widened afterwards would have.
        y = y.to(X.dtype.element_ty)
    store_split(y, Y, rows, Work, rows, N, Tickets, pid, tl.program_id(1), row_mask, SPLIT)


@triton.jit
def _gemv_dot_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    pdl_enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(W + safe_n[None, :] * stride_wn + offs_k[:, None], eviction_policy="evict_first")
        else:
            k_mask = offs_k < K
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(W + safe_n[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None], other=0.0,
                        eviction_policy="evict_first")
        acc = tl.dot(x, w, acc)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(X.dtype.element_ty).to(Y.dtype.element_ty),
             mask=m_mask[:, None] & (offs_n < N)[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [M, K] (or [K]) times weight [N, K]^T -> [M, N] (or [N]), in x's dtype, float32 accumulation.
    M is 1, or up to 16 with `tiles.kind == "dot"`. `out` may be float32 for a half-precision x (not with
    a split): the result is rounded to x's dtype and stored widened, the values of a cast afterwards
    without its launch."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be 2-D with contiguous rows, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    n, k = weight.shape
    tiles = tiles or GemvTiles()
    if tiles.kind not in ("rows", "dot"):
        raise ValueError(f"tiles.kind must be 'rows' or 'dot', got {tiles.kind!r}")
    if tiles.split < 1 or (tiles.kind == "dot" and tiles.split != 1):
        raise ValueError(f"tiles.split must be 1, or more for 'rows' tiles; got {tiles.split} for {tiles.kind!r}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    if out is not None and out.dtype != x.dtype and (out.dtype != torch.float32 or tiles.split != 1):
        raise ValueError(f"out must be {x.dtype}, or float32 without a split; got {out.dtype} with split {tiles.split}")
    if tiles.kind == "dot" and x.dim() == 2 and 1 <= x.shape[0] <= DOT_MAX_ROWS and x.shape[1] == k:
        return _gemv_dot(x, weight, out, tiles)
    if x.numel() != k or (x.dim() == 2 and x.shape[0] != 1) or x.dim() > 2:
        raise ValueError(f"x must be {'1 to 16 rows' if tiles.kind == 'dot' else 'one row'} of {k} features, "
                         f"got shape {tuple(x.shape)}")
    if tiles.kind == "dot":
        return _gemv_dot(x.reshape(1, k), weight, out, tiles).view(n)
    x_flat = x.reshape(k)
    if x_flat.stride(0) != 1:
        x_flat = x_flat.contiguous()
    out = _row_out(out, n, x)
    _launch_rows(x_flat, weight, out, tiles)
    return out.view(x.shape[:-1] + (n,)) if x.dim() == 2 else out.view(n)


def reads_ahead(weight: torch.Tensor) -> bool:
    """Whether a "rows" launch over `weight` reads its first weight tile before its PDL wait: a weight of at
    most PRELOAD_MAX_WEIGHT_BYTES, unless RS_PDL_PRELOAD=0."""
    return preload_weights() and weight.numel() * weight.element_size() <= PRELOAD_MAX_WEIGHT_BYTES


def tiles_read_ahead(weight: torch.Tensor, block_k: int, split: int = 1) -> int:
    """How many of a "rows" launch's weight tiles are read before its PDL wait: 0 where reads_ahead says
    no, else 1, or with RS_PDL_PRELOAD_SLICE=1 up to PRELOAD_SLICE_TILES but no more than a program's
    part of the row (K / split) has."""
    if not reads_ahead(weight):
        return 0
    wanted = PRELOAD_SLICE_TILES if os.environ.get(PRELOAD_SLICE_ENV, "0") == "1" else 1
    return min(wanted, triton.cdiv(weight.shape[1] // split, block_k))


def _row_out(out: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=like.dtype, device=like.device)
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with {n} elements, got {tuple(out.shape)}")
    return out


def _launch_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    tiles: GemvTiles,
    prologue: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    n, k = weight.shape
    split = tiles.split
    if not tiles.fits(k):
        raise ValueError(f"a split of {split} needs K ({k}) a multiple of {split} x block_k ({tiles.block_k})")
    row_blocks = triton.cdiv(n, tiles.block_n)
    if split > 1:
        check_tiles(row_blocks)
    _gemv_kernel[(row_blocks, split)](
        x,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        x if residual is None else residual,
        x if norm_weight is None else norm_weight,
        x if residual_out is None else residual_out,
        eps,
        split_workspace(split, n, out),
        ticket_counters(out.device) if split > 1 else out,
        k // split,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        BLOCK_FULL=triton.next_power_of_2(k) if prologue == 1 else 1,
        PDL=pdl_mode(pdl := launch_options(weight.device)),
        PRELOAD=tiles_read_ahead(weight, tiles.block_k, split),
        SPLIT=split,
        **pdl,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _check_row_operands(x: torch.Tensor, features: int, weight: torch.Tensor, tiles: GemvTiles, name: str) -> None:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be 2-D with contiguous rows, got shape {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    check_prologue_row(x, features, tiles, name)


def check_prologue_row(x: torch.Tensor, features: int, tiles: GemvTiles, name: str) -> None:
    """A fused-prologue product's input (here and kernels/fp8_gemv.py's): one contiguous row of
    `features`, with "rows" tiles."""
    if tiles.kind != "rows":
        raise ValueError(f"{name} takes 'rows' tiles, got kind {tiles.kind!r}")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != features or x.stride(1) != 1:
        raise ValueError(f"x must be one contiguous row of {features} features, got shape {tuple(x.shape)}")


def rmsnorm_outputs(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked norm operands' (out [1, n], residual_out) of an rmsnorm prologue: residual_out is a
    new buffer for x + residual, or x itself without a residual."""
    k = x.shape[1]
    if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous of shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    return out, (torch.empty_like(x) if residual is not None else x)


def rmsnorm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    tiles: GemvTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) W^T, x + residual) for one row x [1, K] in one launch: the decoder layer's
    fused add-RMSNorm and the projection after it (kernels/rmsnorm.py's rounding). Without a residual the
    norm is of x alone and x itself is returned as the residual."""
    tiles = tiles or GemvTiles()
    n, k = weight.shape
    _check_row_operands(x, k, weight, tiles, "rmsnorm_gemv")
    out, residual_out = rmsnorm_outputs(x, residual, norm_weight, n)
    _launch_rows(x, weight, out, tiles, prologue=1, residual=residual, norm_weight=norm_weight,
                 residual_out=residual_out if residual is not None else None, eps=eps)
    return out, residual_out


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, tiles: GemvTiles | None = None) -> torch.Tensor:
    """(silu(gate) * up) W^T for one row gate_up [1, 2K] (gate columns then up columns), in one launch:
    the gated MLP's activation computed on the fly as the down projection reads its input."""
    tiles = tiles or GemvTiles()
    n, k = weight.shape
    _check_row_operands(gate_up, 2 * k, weight, tiles, "silu_mul_gemv")
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _launch_rows(gate_up, weight, out, tiles, prologue=2)
    return out


def _gemv_dot(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, tiles: GemvTiles) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.numel() != m * n or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with {m * n} elements, got {tuple(out.shape)}")
    out2 = out.view(m, n)
    _gemv_dot_kernel[(triton.cdiv(n, tiles.block_n),)](
        x,
        weight,
        out2,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out2.stride(0),
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        BLOCK_M=DOT_MAX_ROWS,
        EVEN_K=k % tiles.block_k == 0,
        PDL=pdl_mode(pdl := launch_options(weight.device)),
        **pdl,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out2
