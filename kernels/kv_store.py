"""Write the new tokens' K and V into one layer's pool rows in a single launch.

One program per token copies its K row and V row ([kv_heads * head_dim] each, any row stride, cast to the
pool's dtype) to pool slot out_cache_loc[token]. Equivalent to two index_put calls, in one launch and
without materializing contiguous copies of strided k/v views.

A float8 pool (services/worker/mem/memory_pool.py) stores fp8(clamp(x * (1 / scale), -max, max)), rounded
to nearest even, with the layer's K or V scale; `to_pool` is that conversion, shared with the fused
prologue (qk_norm_rope.py) and the extend kernel's rounding of the new tokens (extend_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 pool dtype; 0.0 for any other dtype (stored as cast)."""
    return float(torch.finfo(dtype).max) if dtype in _FP8_DTYPES else 0.0


@triton.jit
def to_pool(x, inv_scale, Buf, FP8_MAX: tl.constexpr):
    """x as the pool `Buf` points into stores it: a float8 pool (FP8_MAX > 0) gets x * inv_scale (in
    float32) clipped to +-FP8_MAX, then rounded to nearest even; any other pool a plain cast."""
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(Buf.dtype.element_ty)


@triton.jit
def _kv_store_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Loc,
    stride_k,
    stride_v,
    stride_kb,
    stride_vb,
    width,
    inv_k_scale,
    inv_v_scale,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + token).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    k = tl.load(K + token * stride_k + cols, mask=mask)
    v = tl.load(V + token * stride_v + cols, mask=mask)
    tl.store(K_buf + slot * stride_kb + cols, to_pool(k, inv_k_scale, K_buf, FP8_MAX), mask=mask)
    tl.store(V_buf + slot * stride_vb + cols, to_pool(v, inv_v_scale, V_buf, FP8_MAX), mask=mask)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_buffer/v_buffer [slots, kv_heads, head_dim] (contiguous per row); k, v [n, kv_heads * head_dim]
    or [n, kv_heads, head_dim]; loc [n] slot indices. k_scale / v_scale: a float8 pool's scales."""
    width = k_buffer.shape[1] * k_buffer.shape[2]
    k2 = k.reshape(k.shape[0], -1) if k.dim() == 3 else k
    v2 = v.reshape(v.shape[0], -1) if v.dim() == 3 else v
    if k2.shape != (loc.shape[0], width) or v2.shape != (loc.shape[0], width):
        raise ValueError(f"k/v: expected [{loc.shape[0]}, {width}], got {tuple(k2.shape)}, {tuple(v2.shape)}")
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        raise ValueError("k/v: the last axis must be contiguous")
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.stride(2) != 1 or buf.stride(1) != buf.shape[2]:
            raise ValueError(f"{name}: each slot's [kv_heads, head_dim] block must be contiguous")
    if k_buffer.dtype != v_buffer.dtype:
        raise ValueError(
            f"k_buffer and v_buffer must share a dtype, got {k_buffer.dtype} and {v_buffer.dtype}"
        )
    if loc.shape[0] == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _kv_store_kernel[(loc.shape[0], triton.cdiv(width, block))](
        k2,
        v2,
        k_buffer,
        v_buffer,
        loc,
        k2.stride(0),
        v2.stride(0),
        k_buffer.stride(0),
        v_buffer.stride(0),
        width,
        1.0 / k_scale,
        1.0 / v_scale,
        BLOCK=block,
        FP8_MAX=fp8_max(k_buffer.dtype),
        num_warps=4,
    )
