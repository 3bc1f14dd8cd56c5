"""Block-FP8 products for 1 to 16 rows (decode) on the FP8 tensor cores, bound by the weight's bytes.

The one-row GEMV of kernels/fp8_gemv.py converts every fp8 weight element and multiplies it on the CUDA
cores: about five instructions an element, and at the bandwidth of an H200 that is more than the SMs
issue, so it streamed 0.4-0.7 of copy bandwidth. Here nothing touches a weight element but the
tensor core: each program streams a [BLOCK_N, 128] fp8 weight tile through shared memory (the
pipelined async copies Triton makes for a dot operand) into an fp8 x fp8 product against the rows,
transposed and padded to BLOCK_M = 16 columns (on sm90 a wgmma m64n16k32; below BLOCK_N 64, mma.sync).

The rows are quantized to e4m3 inside the kernel, per row and 128-column group, exactly as
kernels/fp8_gemm.per_token_group_quant_fp8 does for the batched GEMM (scale = max(|x|, eps) / 448,
x / scale rounded to nearest): the activation rounding SGLang and vLLM apply to block-FP8 models at
every batch size, and the same one a prompt's prefill applies here. Each group's product is scaled by
its weight block's scale times the row's group scale before it joins the float32 sum, one group per
loop turn (the promotion DeepSeek-V3 describes for FP8 accumulation).

Split-K: a decode-sized N makes too few programs to fill the GPU (N = 4096 in tiles of 64 rows is 64
programs for 132 SMs), so K is split across programs too, the parts added in a fixed order by the
tile's last program (kernels/split_reduce.py).

One-row prologues as in kernels/gemv.py (the same jit helpers and rounding): RMSNorm of the row
(adding the residual first, program (0, 0) writing the sum) and SiLU-and-mul of a gate_up row.

Under programmatic dependent launch (kernels/pdl.py) each program's first weight tile is read before the
wait for the kernel before it (read_ahead): a kernel boundary costs these short programs (two to three
128-column turns each) about as much as their weights take to stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import _round_to_e4m3_grid, per_token_group_quant_fp8
from kernels.fp8_reference import ACTIVATION_DTYPES, FP8_EPS, FP8_MAX, check_block_weight
from kernels.gemv import (
    GemvTiles,
    _weight_tile,
    check_prologue_row,
    prologue_input,
    rmsnorm_outputs,
    rmsnorm_rstd,
)
from kernels.interpreter_compat import interpreting
from kernels.pdl import launch_options, pdl_enter, pdl_gate, pdl_mode, pdl_release, preload_weights
from kernels.split_reduce import check_tiles, split_workspace, store_split, ticket_counters

MMA_MAX_ROWS = 16
GROUP_K = 128  # the activation quantization group and the K of one loop turn


@dataclass(frozen=True)
class MmaGemvTiles:
    block_n: int = 128  # weight rows per program: 64 (a wgmma's M) or more; below 64, mma.sync
    programs: int = 528  # split K until the launch has about this many programs (4 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2
    unroll: int = 1  # 128-column groups a loop turn (their tiles' copies issued together)
    prequant: bool = False  # quantize the rows in a kernel of their own first (per_token_group_quant_fp8)


# The H200 sweep's best or within 5 % of it at every Qwen3-8B decode shape (bench/gpu_fp8_mma.py,
# gpu_fp8_mma_2026-12-03_b): 128 rows, K split to ~4 programs an SM, two copies in flight.
DEFAULT_MMA_TILES = MmaGemvTiles()


def mma_gemv_supported(
    n: int, k: int, block_size: tuple[int, int], tiles: MmaGemvTiles = DEFAULT_MMA_TILES
) -> bool:
    """Whether a weight [n, k] with this block size fits the kernel: K whole 128-column groups inside
    scale blocks of 128 columns, and tiles of rows that stay inside one row of block scales."""
    bn, bk = block_size
    return k % GROUP_K == 0 and bk == GROUP_K and bn % tiles.block_n == 0


def split_for(n: int, k: int, tiles: MmaGemvTiles) -> tuple[int, int]:
    """(splits, columns per split): the fewest splits of K's groups that bring the launch to
    tiles.programs programs, every split a whole number of loop turns (tiles.unroll groups)."""
    blocks, turns = triton.cdiv(n, tiles.block_n), triton.cdiv(k // GROUP_K, tiles.unroll)
    want = min(turns, max(1, triton.cdiv(tiles.programs, blocks)))
    per_split = triton.cdiv(turns, want)
    return triton.cdiv(turns, per_split), per_split * tiles.unroll * GROUP_K


def read_ahead(pdl: bool, prologue: int, prequant: bool, tiles: MmaGemvTiles) -> tuple[bool, bool]:
    """(EARLY, PRELOAD): how a launch reads its first weight tile before the PDL wait, where PDL is on and
    RS_PDL_PRELOAD is not 0. A row without RMSNorm's statistics (plain or SiLU-and-mul) waits inside the
    loop's turns, so the pipelined copies issued before the loop run ahead (EARLY); an RMSNorm row must
    wait before the loop for its statistics, so its first tile is read into registers before the wait
    (PRELOAD). H100, Qwen3-8B shape, `--quantization fp8` batch-1 decode through the Engine (bench/gpu_pdl.py
    --env RS_PDL_PRELOAD, outputs identical): 257.9 -> 268.2 tok/s. EARLY on the RMSNorm rows instead
    (their statistics in the first turn) was 0.88x: it doubled their registers."""
    if not (pdl and preload_weights()) or prequant or tiles.unroll != 1:
        return False, False
    return prologue in (0, 2), prologue == 1


@triton.jit
def _group_product(X, W, scale_row, Residual, Norm_w, safe_rows, offs_m, m_mask, k0, k_end, K, stride_xm,
                   stride_wn, rstd, fp8_eps, fp8_max, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                   GROUP: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   ROUND_IN_F32: tl.constexpr, MASKED: tl.constexpr, w_pre=None):  # fmt: skip
    """The [BLOCK_N, BLOCK_M] product of the weight's columns k0..k0+GROUP with the rows' group there,
    quantized, times the two scales; zero where MASKED and k0 >= k_end (an unrolled turn's overhang)."""
    cols = k0 + tl.arange(0, GROUP)
    valid = k0 < k_end
    if ROWS == 1:
        # One row: quantize its [GROUP] group alone, then place it in column 0 of the padded operand.
        if PROLOGUE == 0:
            x1 = tl.load(X + cols, mask=(cols < K) & valid, other=0.0).to(tl.float32)
        else:
            x1 = prologue_input(X, Residual, Norm_w, cols, K, rstd, PROLOGUE, HAS_RESIDUAL, True)
            if MASKED:
                x1 = tl.where(valid, x1, 0.0)
        amax = tl.maximum(tl.max(tl.abs(x1), axis=0), fp8_eps)
        s1 = tl.math.div_rn(amax, fp8_max)
        # x * (448 / amax), not x / scale: one division a group instead of one an element (Triton
        # divides after broadcasting the row into the operand's layout, 16 copies a thread).
        q1 = tl.clamp(x1 * tl.math.div_rn(fp8_max, amax), -fp8_max, fp8_max)
        if ROUND_IN_F32:
            q1 = _round_to_e4m3_grid(q1)
        q = tl.where(offs_m[None, :] == 0, q1[:, None], 0.0)
        x_scale = tl.where(offs_m == 0, s1, 0.0)
    else:
        # [GROUP, BLOCK_M]: column m is row m's group, quantized as per_token_group_quant_fp8 does.
        x_mask = m_mask[None, :] & valid
        x = tl.load(X + offs_m[None, :] * stride_xm + cols[:, None], mask=x_mask, other=0.0).to(tl.float32)
        x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), fp8_eps), fp8_max)
        q = tl.clamp(tl.math.div_rn(x, x_scale[None, :]), -fp8_max, fp8_max)
        if ROUND_IN_F32:
            q = _round_to_e4m3_grid(q)
    w_ptrs = W + safe_rows[:, None] * stride_wn + cols[None, :]
    if w_pre is not None:  # the tile read before the wait (PRELOAD)
        w = w_pre
        w_scale = tl.load(scale_row + k0 // GROUP)
    elif MASKED:
        w = tl.load(w_ptrs, mask=valid, other=0.0, eviction_policy="evict_first")
        w_scale = tl.load(scale_row + k0 // GROUP, mask=valid, other=0.0)
    else:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        w_scale = tl.load(scale_row + k0 // GROUP)
    part = tl.dot(w, q.to(W.dtype.element_ty))
    return part * (w_scale * x_scale[None, :])


@triton.jit
def _fp8_mma_gemv_kernel(
    X,
    W,
    W_scale,
    Y,
    Work,
    Tickets,
    X_scale,
    stride_sm,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ym,
    group_n,
    k_per_split,
    Residual,
    Norm_w,
    Res_out,
    eps,
    fp8_eps,
    fp8_max,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    UNROLL: tl.constexpr,
    PREQUANT: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    # Rows past N read row 0 (every load unmasked, so the copies stay whole); they are never stored.
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    scale_row = W_scale + ((pid_n * BLOCK_N) // group_n).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if EARLY:
        # The wait inside the turns (a row without RMSNorm's statistics): the pipeliner's first weight
        # copies, issued before the loop, are in flight while the kernel before this one finishes. Every
        # activation pointer carries pdl_gate's 0, so no read of one is moved above the wait.
        for k0 in range(k_start, k_end, GROUP):
            gate = pdl_gate(PDL)
            pdl_release(PDL)
            acc += _group_product(X + gate, W, scale_row, Residual, Norm_w, safe_rows, offs_m, m_mask, k0, k_end, K,
                                  stride_xm, stride_wn, 1.0, fp8_eps, fp8_max, BLOCK_M, ROWS, GROUP, PROLOGUE,
                                  HAS_RESIDUAL, ROUND_IN_F32, False)  # fmt: skip
    else:
        if PRELOAD:
            # RMSNorm's row (PROLOGUE 1) needs the wait before the loop, and the loop's copies start after it:
            # the first tile is read into registers before the wait instead (kernels/gemv.py's PRELOAD).
            w_first = _weight_tile(W, safe_rows, stride_wn, k_start + tl.arange(0, GROUP), K, True)
        pdl_enter(PDL)
        rstd = rmsnorm_rstd(X, Residual, Res_out, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_FULL)
        if PRELOAD:
            acc += _group_product(X, W, scale_row, Residual, Norm_w, safe_rows, offs_m, m_mask, k_start, k_end, K,
                                  stride_xm, stride_wn, rstd, fp8_eps, fp8_max, BLOCK_M, ROWS, GROUP, PROLOGUE,
                                  HAS_RESIDUAL, ROUND_IN_F32, False, w_first)  # fmt: skip
        if PREQUANT:
            # X holds the rows already quantized (fp8 [M, K]) and X_scale their group scales ([M, K / GROUP]):
            # both operands stream through the copies Triton pipelines for a dot, no reduction in the loop.
            for k0 in range(k_start, k_end, GROUP):
                cols = k0 + tl.arange(0, GROUP)
                q = tl.load(X + offs_m[None, :] * stride_xm + cols[:, None], mask=m_mask[None, :], other=0.0)
                w = tl.load(W + safe_rows[:, None] * stride_wn + cols[None, :], eviction_policy="evict_first")
                part = tl.dot(w, q)
                x_scale = tl.load(X_scale + offs_m * stride_sm + k0 // GROUP, mask=m_mask, other=0.0)
                acc += part * (tl.load(scale_row + k0 // GROUP) * x_scale[None, :])
        else:
            # UNROLL groups a turn: their weight tiles are issued together, UNROLL * 128 contiguous bytes a row.
            for k0 in range(k_start + GROUP if PRELOAD else k_start, k_end, GROUP * UNROLL):
                for u in tl.static_range(UNROLL):
                    acc += _group_product(X, W, scale_row, Residual, Norm_w, safe_rows, offs_m, m_mask, k0 + u * GROUP,
                                          k_end, K, stride_xm, stride_wn, rstd, fp8_eps, fp8_max, BLOCK_M, ROWS, GROUP,
                                          PROLOGUE, HAS_RESIDUAL, ROUND_IN_F32, UNROLL > 1)  # fmt: skip
    out_mask = row_mask[:, None] & m_mask[None, :]
    out_offs = offs_m[None, :] * stride_ym + rows[:, None]
    # Work is [SPLIT, BLOCK_M * N] float32: a split's part of row m, column n at m * N + n.
    part_offs = offs_m[None, :] * N + rows[:, None]
    store_split(acc, Y, out_offs, Work, part_offs, BLOCK_M * N, Tickets, pid_n, pid_k, out_mask, SPLIT)


def _launch(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    out: torch.Tensor,
    tiles: MmaGemvTiles,
    prologue: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    n, k = w_q.shape
    if not mma_gemv_supported(n, k, block_size, tiles):
        raise ValueError(
            f"fp8 mma gemv needs K a multiple of {GROUP_K} with {GROUP_K}-column scale blocks and row blocks a "
            f"multiple of {tiles.block_n}; got weight [{n}, {k}], block size {tuple(block_size)}"
        )
    m = x.shape[0] if prologue == 0 else 1
    prequant = tiles.prequant and prologue == 0
    pdl = launch_options(x.device)
    early, preload = read_ahead(bool(pdl), prologue, prequant, tiles)
    split, k_per_split = split_for(n, k, tiles)
    blocks = triton.cdiv(n, tiles.block_n)
    check_tiles(blocks)
    work = split_workspace(split, MMA_MAX_ROWS * n, out)
    x_rows, x_scale = x, out
    if prequant:
        x_rows, x_scale = per_token_group_quant_fp8(x, GROUP_K)
    _fp8_mma_gemv_kernel[(blocks, split)](
        x_rows,
        w_q,
        w_scale_inv,
        out,
        work,
        ticket_counters(x.device),
        x_scale,
        x_scale.stride(0),
        m,
        n,
        k,
        x_rows.stride(0),
        w_q.stride(0),
        w_scale_inv.stride(0),
        out.stride(0),
        block_size[0],
        k_per_split,
        x if residual is None else residual,
        x if norm_weight is None else norm_weight,
        x if residual_out is None else residual_out,
        eps,
        FP8_EPS,
        FP8_MAX,
        BLOCK_N=tiles.block_n,
        BLOCK_M=MMA_MAX_ROWS,
        ROWS=1 if m == 1 else MMA_MAX_ROWS,
        GROUP=GROUP_K,
        SPLIT=split,
        UNROLL=tiles.unroll,
        PREQUANT=prequant,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        BLOCK_FULL=triton.next_power_of_2(k) if prologue == 1 else 1,
        ROUND_IN_F32=interpreting(),
        PDL=pdl_mode(pdl),
        EARLY=early,
        PRELOAD=preload,
        **pdl,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fp8_mma_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: MmaGemvTiles = DEFAULT_MMA_TILES,
) -> torch.Tensor:
    """x [M <= 16, K] (bf16/f16/f32) times the block-FP8 weight's transpose, the rows quantized per
    128-column group in the kernel: [M, N] in x.dtype."""
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.shape[1] != k:
        raise ValueError(f"x must be bfloat16/float16/float32 [M, {k}], got {tuple(x.shape)} {x.dtype}")
    m = x.shape[0]
    if not 1 <= m <= MMA_MAX_ROWS:
        raise ValueError(f"fp8_mma_gemv takes 1 to {MMA_MAX_ROWS} rows, got {m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, w_q, w_scale_inv, block_size, out, tiles)
    return out


def fp8_mma_rmsnorm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: MmaGemvTiles = DEFAULT_MMA_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8_gemv.fp8_rmsnorm_gemv on the tensor cores: (rmsnorm(x + residual) W^T, x + residual)
    for one row x [1, K] in one launch; without a residual x itself is returned as the residual."""
    n, _ = _prologue_operands(x, 1, w_q, w_scale_inv, block_size, "fp8_mma_rmsnorm_gemv")
    out, residual_out = rmsnorm_outputs(x, residual, norm_weight, n)
    _launch(x, w_q, w_scale_inv, block_size, out, tiles, prologue=1, residual=residual, norm_weight=norm_weight,
            residual_out=residual_out if residual is not None else None, eps=eps)  # fmt: skip
    return out, residual_out


def fp8_mma_silu_mul_gemv(
    gate_up: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    tiles: MmaGemvTiles = DEFAULT_MMA_TILES,
) -> torch.Tensor:
    """(silu(gate) * up) W^T for one row gate_up [1, 2K] (gate columns then up) in one launch."""
    n, _ = _prologue_operands(gate_up, 2, w_q, w_scale_inv, block_size, "fp8_mma_silu_mul_gemv")
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _launch(gate_up, w_q, w_scale_inv, block_size, out, tiles, prologue=2)
    return out


def _prologue_operands(
    x: torch.Tensor, features: int, w_q: torch.Tensor, w_scale_inv: torch.Tensor, block_size: tuple[int, int],
    name: str,
) -> tuple[int, int]:  # fmt: skip
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name}: x must be bfloat16/float16/float32, got {x.dtype}")
    check_prologue_row(x, features * k, GemvTiles(), name)
    return n, k
