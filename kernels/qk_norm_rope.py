"""Per-head q/k RMSNorm, neox rotary embedding and the KV-pool store, fused into one launch.

Unfused, an attention layer's prologue is up to four launches: RMSNorm of q's heads and of k's heads
(Qwen3; kernels/rmsnorm.py), the rotation and the pool store (kernels/kv_store.py). With the norm and
the store switched off (their arguments left None) it is the rotary kernel alone.
At small batch a decode step is launch-bound, so this kernel does all of it in one: one program per
token reads each of its q and k heads once, normalizes (optional), rotates, writes q and k back in place
and, given the pool, writes the rotated k row and the v row to slot out_cache_loc[token].

The arithmetic is the unfused kernels', rounding for rounding: norm statistics in float32, the
normalized value rounded to the activation dtype before the weight multiplies it and the product
rounded again (Hugging Face's Qwen3RMSNorm), then the rotation in float32 on those rounded values, and
the pool gets the rotated k as stored in k, cast to the pool's dtype (a float8 pool: scaled, clipped
and rounded by kv_store.to_pool, as store_kv does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_store import fp8_max, to_pool
from kernels.pdl import launch_options, pdl_enter, pdl_mode


@triton.jit
def _normed(x, rstd, W, offs, mask, X):
    """x [heads, cols] float32 -> weight * (x * rstd) in float32, with x * rstd and the product each
    rounded to X's dtype first, where Hugging Face rounds them."""
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    dtype = X.dtype.element_ty
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def norm_rotate(x1, x2, rstd, W, offs_i, i_mask, cos, sin, X, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Heads' two rotated halves x1, x2 [heads, half] (float32): normalized with rstd [heads, 1] and the
    norm weight W (HAS_NORM), then rotated; returned in X's dtype. The one place of this arithmetic, so
    kernels/decode_attention.py's fused prologue rounds exactly as this kernel does."""
    if HAS_NORM:
        x1 = _normed(x1, rstd, W, offs_i, i_mask, X)
        x2 = _normed(x2, rstd, W + HALF, offs_i, i_mask, X)
    out1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty)
    return out1, out2


@triton.jit
def rope_heads(
    X, heads, h_mask, stride_h, W, eps, cos, sin, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rows `heads` of one token's X (pointer at the token; each head HEAD_DIM = 2 * HALF wide, a power of
    two, wholly rotated; cos/sin [1, HALF]) normalized and rotated, as [len(heads), HEAD_DIM] in X's dtype;
    masked heads give zeros. Nothing is written."""
    offs_i = tl.arange(0, HALF)
    i_mask = offs_i < HALF
    first = X + heads[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(first, mask=h_mask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=h_mask[:, None], other=0.0).to(tl.float32)
    rstd = 1.0
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
    out1, out2 = norm_rotate(x1, x2, rstd, W, offs_i, i_mask, cos, sin, X, HAS_NORM, HALF)
    # [heads, half, 2] -> [heads, 2, half] -> [heads, BLOCK_D]: the first half's columns, then the second's.
    return tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), (out1.shape[0], HEAD_DIM))


@triton.jit
def store_new_kv(
    K_new, V_new, kv_head, stride_kh, stride_vh, K_w, eps, cos, sin, K_buf, V_buf, slot, stride_kbs, stride_kbh,
    stride_vbs, stride_vbh, inv_k_scale, inv_v_scale, HAS_NORM: tl.constexpr, FP8_MAX: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
):
    """One new token's KV head `kv_head` into the pool at `slot`: k normalized and rotated (rope_heads),
    v as it is, each cast to the pool's dtype as _qk_norm_rope_kernel stores them."""
    head = kv_head + tl.arange(0, 1)
    k = rope_heads(K_new, head, head >= 0, stride_kh, K_w, eps, cos, sin, HAS_NORM, HEAD_DIM, HALF)
    cols = tl.arange(0, HEAD_DIM)[None, :]
    tl.store(K_buf + slot * stride_kbs + head[:, None] * stride_kbh + cols, to_pool(k, inv_k_scale, K_buf, FP8_MAX))
    v = tl.load(V_new + head[:, None] * stride_vh + cols)
    tl.store(V_buf + slot * stride_vbs + head[:, None] * stride_vbh + cols, to_pool(v, inv_v_scale, V_buf, FP8_MAX))


@triton.jit
def _norm_rope_heads(
    X,
    token,
    stride_t,
    stride_h,
    num_heads,
    W,
    eps,
    cos,
    sin,
    Buf,
    slot,
    stride_bs,
    stride_bh,
    inv_scale,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """Normalize (optionally) and rotate every head of one token's row of X in place; with STORE also
    write the result to Buf's slot. A head is read as its two rotated halves and the pass-through rest."""
    heads = tl.arange(0, BLOCK_HEADS)
    h_mask = heads < num_heads
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    mask = h_mask[:, None] & i_mask[None, :]
    first = X + token * stride_t + heads[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if REST > 0:
        offs_r = 2 * HALF + tl.arange(0, BLOCK_REST)
        r_col_mask = offs_r < HEAD_DIM
        r_mask = h_mask[:, None] & r_col_mask[None, :]
        rest = X + token * stride_t + heads[:, None] * stride_h + offs_r[None, :]
        xr = tl.load(rest, mask=r_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if REST > 0:
            sum_sq += tl.sum(xr * xr, 1)
        rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        if REST > 0:
            xr = _normed(xr, rstd, W, offs_r, r_col_mask, X)
    else:
        rstd = 1.0
    out1, out2 = norm_rotate(x1, x2, rstd, W, offs_i, i_mask, cos, sin, X, HAS_NORM, HALF)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    if REST > 0:
        xr = xr.to(X.dtype.element_ty)
        if HAS_NORM:
            tl.store(rest, xr, mask=r_mask)
    if STORE:
        buf = Buf + slot * stride_bs + heads[:, None] * stride_bh
        tl.store(buf + offs_i[None, :], to_pool(out1, inv_scale, Buf, FP8_MAX), mask=mask)
        tl.store(buf + HALF + offs_i[None, :], to_pool(out2, inv_scale, Buf, FP8_MAX), mask=mask)
        if REST > 0:
            tl.store(buf + offs_r[None, :], to_pool(xr, inv_scale, Buf, FP8_MAX), mask=r_mask)


@triton.jit
def _qk_norm_rope_kernel(
    Positions,
    Q,
    K,
    V,
    Cos,
    Sin,
    Q_w,
    K_w,
    K_buf,
    V_buf,
    Loc,
    eps,
    inv_k_scale,
    inv_v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    num_q_heads,
    num_k_heads,
    HAS_NORM: tl.constexpr,
    HAS_POOL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_sin + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    slot = token
    if HAS_POOL:
        slot = tl.load(Loc + token).to(tl.int64)
    _norm_rope_heads(
        Q, token, stride_qt, stride_qh, num_q_heads, Q_w, eps, cos, sin, K_buf, slot, stride_kbs, stride_kbh,
        inv_k_scale, HAS_NORM, False, FP8_MAX, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, BLOCK_QH,
    )
    _norm_rope_heads(
        K, token, stride_kt, stride_kh, num_k_heads, K_w, eps, cos, sin, K_buf, slot, stride_kbs, stride_kbh,
        inv_k_scale, HAS_NORM, HAS_POOL, FP8_MAX, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, BLOCK_KH,
    )
    if HAS_POOL:
        heads = tl.arange(0, BLOCK_KH)
        cols = tl.arange(0, BLOCK_DIM)
        mask = (heads < num_k_heads)[:, None] & (cols < HEAD_DIM)[None, :]
        v = tl.load(V + token * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)
        v_dst = V_buf + slot * stride_vbs + heads[:, None] * stride_vbh + cols[None, :]
        tl.store(v_dst, to_pool(v, inv_v_scale, V_buf, FP8_MAX), mask=mask)


def _heads_view(x: torch.Tensor, tokens: int, head_dim: int, name: str) -> torch.Tensor:
    """x [tokens, heads * head_dim] or [tokens, heads, head_dim] as the 3-D view (no copy)."""
    if x.dim() not in (2, 3) or x.shape[0] != tokens:
        raise ValueError(f"{name}: expected [{tokens}, heads * head_dim], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous")
    if x.dim() == 3:
        if x.shape[2] != head_dim:
            raise ValueError(f"{name}: last dimension {x.shape[2]} != head_dim {head_dim}")
        return x
    if x.shape[1] % head_dim != 0:
        raise ValueError(f"{name}: width {x.shape[1]} is not a multiple of head_dim {head_dim}")
    return x.view(tokens, x.shape[1] // head_dim, head_dim)


def _check_weights(q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, head_dim: int) -> None:
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight: pass both (per-head RMSNorm) or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"{name}: expected a contiguous [{head_dim}] tensor, got shape {tuple(w.shape)}")


def _check_pool(
    v3: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out_cache_loc: torch.Tensor
) -> None:
    tokens, kv_heads, head_dim = v3.shape
    if out_cache_loc.shape != (tokens,):
        raise ValueError(f"out_cache_loc: expected [{tokens}] slots, got shape {tuple(out_cache_loc.shape)}")
    for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3 or buf.shape[1:] != (kv_heads, head_dim):
            raise ValueError(
                f"{name}: expected [slots, {kv_heads}, {head_dim}], got shape {tuple(buf.shape)}"
            )
        if buf.stride(2) != 1:
            raise ValueError(f"{name}: the last axis must be contiguous")


def qk_norm_rope_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    *,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_buffer: torch.Tensor | None = None,
    v_buffer: torch.Tensor | None = None,
    out_cache_loc: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [tokens, heads * head_dim] and k [tokens, kv_heads * head_dim] (row strides are
    free: views into a fused qkv output work): per-head RMSNorm with q_weight / k_weight [head_dim]
    (both None: no norm), then neox rotary at `positions` [tokens] from cos_cache/sin_cache
    [max_position, rotary_dim / 2]. With v, k_buffer, v_buffer [slots, kv_heads, head_dim] and
    out_cache_loc [tokens], also stores the rotated k and v at those slots (a float8 pool: with its
    k_scale / v_scale). Returns (q, k)."""
    half = cos_cache.shape[1] if cos_cache.dim() == 2 else 0
    if cos_cache.dim() != 2 or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"cos_cache/sin_cache: expected two equal [max_position, rotary_dim / 2] tables, got shapes "
            f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}"
        )
    if half == 0 or 2 * half > head_dim:
        raise ValueError(f"cos_cache width {half} gives rotary_dim {2 * half}, not in 2 .. head_dim {head_dim}")
    if cos_cache.stride(-1) != 1 or sin_cache.stride(-1) != 1:
        raise ValueError("cos_cache and sin_cache: the last axis must be contiguous")
    if positions.dim() != 1:
        raise ValueError(f"positions: expected [tokens], got shape {tuple(positions.shape)}")
    tokens = positions.shape[0]
    q3 = _heads_view(q, tokens, head_dim, "q")
    k3 = _heads_view(k, tokens, head_dim, "k")
    _check_weights(q_weight, k_weight, head_dim)
    pool_args = (v, k_buffer, v_buffer, out_cache_loc)
    has_pool = v is not None
    if any((a is None) == has_pool for a in pool_args):
        raise ValueError("v, k_buffer, v_buffer and out_cache_loc: pass all four (store to the pool) or none")
    v3 = k3
    if has_pool:
        v3 = _heads_view(v, tokens, head_dim, "v")
        if v3.shape != k3.shape:
            raise ValueError(f"v: shape {tuple(v3.shape)} != k's {tuple(k3.shape)} (as heads)")
        _check_pool(v3, k_buffer, v_buffer, out_cache_loc)
    if tokens == 0:
        return q, k
    # Unused pointer arguments get a harmless stand-in; the constexpr flags keep the kernel off them.
    k_buf = k_buffer if has_pool else k3
    v_buf = v_buffer if has_pool else k3
    rest = head_dim - 2 * half
    _qk_norm_rope_kernel[(tokens,)](
        positions,
        q3,
        k3,
        v3,
        cos_cache,
        sin_cache,
        q_weight if q_weight is not None else q3,
        k_weight if k_weight is not None else k3,
        k_buf,
        v_buf,
        out_cache_loc if has_pool else positions,
        eps,
        1.0 / k_scale,
        1.0 / v_scale,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        q3.shape[1],
        k3.shape[1],
        HAS_NORM=q_weight is not None,
        HAS_POOL=has_pool,
        FP8_MAX=fp8_max(k_buf.dtype) if has_pool else 0.0,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        REST=rest,
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        BLOCK_QH=triton.next_power_of_2(q3.shape[1]),
        BLOCK_KH=triton.next_power_of_2(k3.shape[1]),
        **_pdl_options(q3.device),
        num_warps=4,
    )
    return q, k


def _pdl_options(device: torch.device) -> dict:
    options = launch_options(device)
    return {"PDL": pdl_mode(options), **options}
