"""Per-token-group activation quantization to e4m3 (`per_token_group_quant_fp8`): each row cut into groups
of `group_size` features, scale = max(|x_group|, eps) / 448, x / scale rounded to e4m3. The batched w8a8
GEMM (kernels/fp8_gemm.py) takes its output; kernels/fp8_gemv_mma.py rounds decode rows the same way
inside its loop and shares `_round_to_e4m3_grid`.

Under Triton's CPU interpreter (tests) a float32 -> fp8 conversion rounds half up and drops the carry
into the exponent when the mantissa rounds over (3.6.0: 124.5 becomes 64, not 128). The quantizer
therefore rounds to the e4m3 grid in float32 first when interpreting (ROUND_IN_F32), so the conversion
it then does is exact; on the GPU the hardware conversion (round to nearest even) runs alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_reference import ACTIVATION_DTYPES, FP8_DTYPE, FP8_EPS, FP8_MAX
from kernels.interpreter_compat import interpreting
from kernels.pdl import launch_options, pdl_enter, pdl_mode


@triton.jit
def _round_to_e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32."""
    bits = v.to(tl.uint32, bitcast=True)
    # Normal e4m3 (|v| >= 2^-6): keep 3 of float32's 23 mantissa bits; a carry moves into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9; 1.5 * 2^14 has a float32 ulp of 2^-9, so the sum rounds to one.
    sub = (tl.abs(v) + 24576.0) - 24576.0
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_groups(x, eps, fp8_max, AXIS: tl.constexpr, ROUND_IN_F32: tl.constexpr):
    """(q, scale) of float32 x whose groups lie along AXIS: scale = max(|group|, eps) / fp8_max (a true
    division), q = x / scale clamped and rounded to e4m3 (still float32). Every quantizer here uses it,
    so the fused ones give the plain one's bits."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=AXIS), eps), fp8_max)
    q = tl.clamp(tl.math.div_rn(x, tl.expand_dims(scale, AXIS)), -fp8_max, fp8_max)
    if ROUND_IN_F32:
        q = _round_to_e4m3_grid(q)
    return q, scale


@triton.jit
def _group_quant_kernel(
    X,
    Q,
    S,
    K,
    num_groups,
    stride_xm,
    stride_qm,
    stride_sm,
    eps,
    fp8_max,
    num_units,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    UNITS: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """A unit is one group of one row (unit u: row u // num_groups, group u % num_groups); a program
    takes UNITS consecutive units, which run on across rows, so short rows still fill a program."""
    pdl_enter(PDL)
    units = tl.program_id(0) * UNITS + tl.arange(0, UNITS)
    rows = (units // num_groups).to(tl.int64)
    groups = units % num_groups
    inner = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + inner[None, :]
    mask = (inner[None, :] < GROUP) & (cols < K) & (units < num_units)[:, None]
    x = tl.load(X + rows[:, None] * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_groups(x, eps, fp8_max, 1, ROUND_IN_F32)
    tl.store(Q + rows[:, None] * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_sm + groups, scale, mask=units < num_units)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/f16/f32) -> (q float8_e4m3fn [M, K], scale float32 [M, ceil(K/group_size)]);
    x ≈ q * scale per group; scale = max(|x_group|, eps) / FP8_MAX."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be 2-D bfloat16/float16/float32, got {tuple(x.shape)} {x.dtype}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    block = triton.next_power_of_2(group_size)
    units = max(1, 2048 // block)
    _group_quant_kernel[(triton.cdiv(m * num_groups, units),)](
        x,
        q,
        scale,
        k,
        num_groups,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        FP8_EPS,
        FP8_MAX,
        m * num_groups,
        GROUP=group_size,
        BLOCK=block,
        UNITS=units,
        ROUND_IN_F32=interpreting(),
        PDL=pdl_mode(pdl := launch_options(x.device)),
        **pdl,
        num_warps=4,
    )
    return q, scale


@triton.jit
def _group_quant_rows(y, rows, row_mask, Q, S, K, stride_qm, stride_sm, eps, fp8_max, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr, GROUP: tl.constexpr, ROUND_IN_F32: tl.constexpr):  # fmt: skip
    """Quantize y [BLOCK_ROWS, BLOCK_COLS] (float32, already rounded as the unfused op's output is) per
    GROUP columns and store the rows and their scales."""
    groups = tl.arange(0, BLOCK_COLS // GROUP)
    inner = tl.arange(0, GROUP)
    yg = tl.reshape(y, [BLOCK_ROWS, BLOCK_COLS // GROUP, GROUP])
    q, scale = _quantize_groups(yg, eps, fp8_max, 2, ROUND_IN_F32)
    cols = groups[None, :, None] * GROUP + inner[None, None, :]
    mask = row_mask[:, None, None] & (cols < K)
    tl.store(Q + rows[:, None, None] * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(
        S + rows[:, None] * stride_sm + groups[None, :],
        scale,
        mask=row_mask[:, None] & (groups[None, :] * GROUP < K),
    )


@triton.jit
def _rmsnorm_group_quant_kernel(
    X,
    Residual,
    W,
    Q,
    S,
    Res_out,
    n_rows,
    K,
    eps,
    stride_xm,
    stride_rm,
    stride_qm,
    stride_sm,
    stride_rom,
    fp8_eps,
    fp8_max,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    GROUP: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """kernels/rmsnorm.py's _rmsnorm_kernel (the same tile of rows, the same sums and roundings), its
    output then quantized per group here instead of written and read back by _group_quant_kernel."""
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_COLS)
    mask = row_mask[:, None] & (cols < K)[None, :]
    dtype = X.dtype.element_ty
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        total = (x + r.to(tl.float32)).to(dtype)
        tl.store(Res_out + rows[:, None] * stride_rom + cols[None, :], total, mask=mask)
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / K + eps)
    w = tl.load(W + cols, mask=cols < K, other=0.0).to(tl.float32)
    y = ((x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
    _group_quant_rows(y, rows, row_mask, Q, S, K, stride_qm, stride_sm, fp8_eps, fp8_max, BLOCK_ROWS, BLOCK_COLS,
                      GROUP, ROUND_IN_F32)  # fmt: skip


@triton.jit
def _silu_mul_group_quant_kernel(
    X,
    Q,
    S,
    n_rows,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    fp8_eps,
    fp8_max,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    GROUP: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """kernels/activation.py's SiLU-and-mul of X = [gate | up] (its formula and rounding), quantized per
    group in the same launch. A program takes BLOCK_COLS columns of BLOCK_ROWS rows."""
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = rows < n_rows
    col0 = tl.program_id(1) * BLOCK_COLS
    cols = col0 + tl.arange(0, BLOCK_COLS)
    mask = row_mask[:, None] & (cols < K)[None, :]
    gate = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + rows[:, None] * stride_xm + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(X.dtype.element_ty).to(tl.float32)
    _group_quant_rows(y, rows, row_mask, Q + col0, S + col0 // GROUP, K - col0, stride_qm, stride_sm, fp8_eps,
                      fp8_max, BLOCK_ROWS, BLOCK_COLS, GROUP, ROUND_IN_F32)  # fmt: skip


def _quant_outputs(
    m: int, k: int, group_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((m, k), dtype=FP8_DTYPE, device=device),
            torch.empty((m, k // group_size), dtype=torch.float32, device=device))  # fmt: skip


def rmsnorm_group_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual): per_token_group_quant_fp8 of rmsnorm(x + residual) (kernels/rmsnorm.py's
    fused_add_rmsnorm, or rmsnorm of x without a residual, when x itself is returned as the residual), in
    one launch and with the same bits, for rows x [M, K] with K a multiple of group_size."""
    m, k = _check_fused_rows(x, k_multiple=group_size, name="rmsnorm_group_quant_fp8")
    if tuple(weight.shape) != (k,):
        raise ValueError(f"rmsnorm_group_quant_fp8: weight must have shape ({k},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rmsnorm_group_quant_fp8: residual must be {tuple(x.shape)} with contiguous rows")
    q, scale = _quant_outputs(m, k, group_size, x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if m == 0:
        return q, scale, res_out
    block_cols = triton.next_power_of_2(k)
    block_rows = max(1, min(16, 2048 // block_cols))  # kernels/rmsnorm.py's tile, so its sums are these
    _rmsnorm_group_quant_kernel[(triton.cdiv(m, block_rows),)](
        x, x if residual is None else residual, weight, q, scale, res_out, m, k, eps, x.stride(0),
        x.stride(0) if residual is None else residual.stride(0), q.stride(0), scale.stride(0), res_out.stride(0),
        FP8_EPS, FP8_MAX, HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        GROUP=group_size, ROUND_IN_F32=interpreting(), PDL=pdl_mode(pdl := launch_options(x.device)), **pdl,
        num_warps=min(16, max(1, block_cols * block_rows // 256)),
    )  # fmt: skip
    return q, scale, res_out


def silu_mul_group_quant_fp8(
    gate_up: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): per_token_group_quant_fp8 of kernels/activation.silu_and_mul(gate_up) in one launch and
    with the same bits, for rows gate_up [M, 2K] (gate columns then up) with K a multiple of group_size."""
    m, k2 = _check_fused_rows(gate_up, k_multiple=2 * group_size, name="silu_mul_group_quant_fp8")
    k = k2 // 2
    q, scale = _quant_outputs(m, k, group_size, gate_up.device)
    if m == 0:
        return q, scale
    block_cols = min(1024, triton.next_power_of_2(k))
    block_rows = max(1, 2048 // block_cols)
    _silu_mul_group_quant_kernel[(triton.cdiv(m, block_rows), triton.cdiv(k, block_cols))](
        gate_up, q, scale, m, k, gate_up.stride(0), q.stride(0), scale.stride(0), FP8_EPS, FP8_MAX,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, GROUP=group_size, ROUND_IN_F32=interpreting(),
        PDL=pdl_mode(pdl := launch_options(gate_up.device)), **pdl, num_warps=4,
    )  # fmt: skip
    return q, scale


def _check_fused_rows(x: torch.Tensor, k_multiple: int, name: str) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be 2-D bfloat16/float16/float32 with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    if x.shape[1] == 0 or x.shape[1] % k_multiple:
        raise ValueError(f"{name}: the row length {x.shape[1]} must be a positive multiple of {k_multiple}")
    return x.shape[0], x.shape[1]
