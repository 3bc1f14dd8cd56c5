"""RMSNorm, plain and fused with the residual add, in one pass over the row.

y = x * rsqrt(mean(x^2) + eps) * weight, statistics in float32. The fused form first forms
r = x + residual, writes r (the next layer's residual) and normalizes it: one read of each input and one
write of each output instead of an add kernel plus a norm kernel. Rounding follows Hugging Face's
Llama/Qwen3 modules (the sum and the normalized value are rounded to the activation dtype before the
next step uses them), so bf16 outputs match theirs.

`zero_centered` (Qwen3.5, Gemma): the checkpoint stores the scale's offset from 1, and the whole
norm stays in float32 until one final rounding: y = (x * rstd * (1 + weight)) rounded, as transformers'
Qwen3_5RMSNorm computes it (layers/layernorm.py's ZeroCenteredRMSNorm is the torch form).

Inputs are 2-D [rows, hidden] or 3-D [tokens, heads, head_dim] (Qwen3's per-head q/k norm on a strided
view of the fused qkv output): the kernel walks rows through two strides, so no copy is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter, pdl_mode


@triton.jit
def _rmsnorm_kernel(
    X,
    Residual,
    W,
    Out,
    Res_out,
    n_rows,
    n_inner,
    n_cols,
    eps,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    stride_o0,
    stride_o1,
    stride_ro0,
    stride_ro1,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outer = (rows // n_inner).to(tl.int64)
    inner = (rows % n_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + (outer * stride_x0 + inner * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(
            Residual + (outer * stride_r0 + inner * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0
        )
        total = (x + r.to(tl.float32)).to(Res_out.dtype.element_ty)
        tl.store(
            Res_out + (outer * stride_ro0 + inner * stride_ro1)[:, None] + cols[None, :], total, mask=mask
        )
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = x * rstd[:, None] * (1.0 + w[None, :])
    else:
        y = (x * rstd[:, None]).to(Out.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(
        Out + (outer * stride_o0 + inner * stride_o1)[:, None] + cols[None, :],
        y.to(Out.dtype.element_ty),
        mask=mask,
    )


def _as_3d(x: torch.Tensor, hidden: int, name: str) -> torch.Tensor:
    if x.shape[-1] != hidden:
        raise ValueError(f"{name}: last dimension {x.shape[-1]} != weight size {hidden}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous")
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    raise ValueError(f"{name}: expected 2 or 3 dimensions, got shape {tuple(x.shape)}")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    zero_centered: bool = False,
) -> None:
    hidden = weight.shape[0]
    x3 = _as_3d(x, hidden, "x")
    o3 = _as_3d(out, hidden, "out")
    r3 = _as_3d(residual, hidden, "residual") if residual is not None else x3
    ro3 = _as_3d(residual_out, hidden, "residual_out") if residual_out is not None else o3
    n_rows = x3.shape[0] * x3.shape[1]
    block_cols = triton.next_power_of_2(hidden)
    # Short rows (per-head norms) are packed several to a program so each moves a useful amount.
    block_rows = max(1, min(16, 2048 // block_cols))
    _rmsnorm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3,
        r3,
        weight,
        o3,
        ro3,
        n_rows,
        x3.shape[1],
        hidden,
        eps,
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        o3.stride(0),
        o3.stride(1),
        ro3.stride(0),
        ro3.stride(1),
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        PDL=pdl_mode(pdl := launch_options(x3.device)),
        **pdl,
        num_warps=min(16, max(1, block_cols * block_rows // 256)),
    )


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last axis of x ([rows, hidden] or [tokens, heads, head_dim]). `out` may be x
    itself (in place); by default a new contiguous tensor. `zero_centered`: scale by (1 + weight)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, None, weight, eps, out, None, zero_centered)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) in one pass; both outputs are new tensors in x's dtype."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, residual_out, zero_centered)
    return out, residual_out
