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
from kernels.pdl import launch_options, pdl_enter


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
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), fp8_max)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max)
    if ROUND_IN_F32:
        q = _round_to_e4m3_grid(q)
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
        PDL=bool(pdl := launch_options(x.device)),
        **pdl,
        num_warps=4,
    )
    return q, scale
