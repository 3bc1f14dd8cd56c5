"""SiLU-and-mul, the gated MLP's activation: [n, 2d] -> silu(x[:, :d]) * x[:, d:] in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter, pdl_mode


@triton.jit
def _silu_and_mul_kernel(X, Out, d, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, 2d] (gate columns then up columns) -> [n, d] in x's dtype, math in float32."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [n, 2d] with a contiguous last axis, got shape {tuple(x.shape)}")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != (x.shape[0], d) or out.stride(1) != 1:
        raise ValueError(f"out: expected shape {(x.shape[0], d)} with a contiguous last axis")
    if x.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
        x,
        out,
        d,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        PDL=pdl_mode(pdl := launch_options(x.device)),
        **pdl,
        num_warps=4,
    )
    return out
