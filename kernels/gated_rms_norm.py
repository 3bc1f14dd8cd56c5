"""Gated RMSNorm of Gated DeltaNet layers (Qwen3.5): y = weight * rmsnorm(x) * silu(gate), one pass.

Per row of head_dim: the statistics and the normalised value in float32, rounded to x's dtype; times
weight in the dtype torch promotes (x's dtype, or float32 when the weight is float32); times
silu(gate) in float32; rounded to x's dtype. That is gdn_ops.gated_rms_norm's (and transformers'
Qwen3_5RMSNormGated's) rounding order, so float32 results agree to a few ulp and bf16 ones nearly
everywhere exactly. The torch form is ~10 elementwise kernels; at decode each is a few microseconds.

x and gate are [rows, head_dim] or [tokens, heads, head_dim], walked through two strides each, so the
gate can be a strided view of the fused in_proj output (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rmsnorm import _as_3d


@triton.jit
def _gated_rms_norm_kernel(
    X, Gate, W, Out,
    n_rows, n_inner, n_cols, eps,
    stride_x0, stride_x1, stride_g0, stride_g1, stride_o0, stride_o1,
    ROUND_SCALED: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outer = (rows // n_inner).to(tl.int64)
    inner = (rows % n_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + (outer * stride_x0 + inner * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    normed = (x * rstd[:, None]).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    scaled = w[None, :] * normed
    if ROUND_SCALED:  # weight * normed in x's dtype (both in it), as torch computes it
        scaled = scaled.to(Out.dtype.element_ty).to(tl.float32)
    gate = tl.load(
        Gate + (outer * stride_g0 + inner * stride_g1)[:, None] + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    y = scaled * (gate * tl.sigmoid(gate))
    tl.store(
        Out + (outer * stride_o0 + inner * stride_o1)[:, None] + cols[None, :],
        y.to(Out.dtype.element_ty),
        mask=mask,
    )


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight * silu(gate) over the last axis of x and gate (same shape, [rows, head_dim] or
    [tokens, heads, head_dim], any outer strides); weight [head_dim]. Returns a new contiguous tensor in
    x's dtype."""
    if gate.shape != x.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [head_dim], got shape {tuple(weight.shape)}")
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    hidden = weight.shape[0]
    x3, g3 = _as_3d(x, hidden, "x"), _as_3d(gate, hidden, "gate")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o3 = _as_3d(out, hidden, "out")
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return out
    block_cols = triton.next_power_of_2(hidden)
    block_rows = max(1, min(16, 2048 // block_cols))  # head_dim rows are short: several to a program
    # Among these dtypes torch promotes weight * x to x's dtype or to float32 (a no-op rounding).
    round_scaled = torch.promote_types(weight.dtype, x.dtype) != torch.float32
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3, g3, weight, o3,
        n_rows, x3.shape[1], hidden, eps,
        x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), o3.stride(0), o3.stride(1),
        ROUND_SCALED=round_scaled, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=min(16, max(1, block_cols * block_rows // 256)),
    )  # fmt: skip
    return out
