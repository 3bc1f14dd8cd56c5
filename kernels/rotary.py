"""Rotary position embedding, neox style (rotate the two halves), applied in place to q and k.

cos_cache[p] = cos(p * inv_freq) and sin_cache[p] = sin(p * inv_freq) (any scaling already folded in),
each of width rotary_dim / 2 (rotary_dim <= head_dim; the channels past it pass through), as
services/worker/layers/rotary.py builds them. One program per token rotates all of its q heads and k heads, so cos and
sin are read once per token and q/k are read and written once each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    offs_i,
    i_mask,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < num_heads)[:, None] & i_mask[None, :]
    first = X + token * stride_t + heads[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions,
    Q,
    K,
    Cos,
    Sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_sin + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q, token, stride_qt, stride_qh, num_q_heads, cos, sin, offs_i, i_mask, HALF, BLOCK_QH)
    _rotate_heads(K, token, stride_kt, stride_kh, num_k_heads, cos, sin, offs_i, i_mask, HALF, BLOCK_KH)


def rotary_neox_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads * head_dim] and k [tokens, kv_heads * head_dim] in place (row strides are
    free, so views into a fused qkv output work). positions [tokens]; cos_cache/sin_cache
    [max_position, rotary_dim / 2]. Returns (q, k)."""
    half = cos_cache.shape[1]
    if sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"sin_cache shape {tuple(sin_cache.shape)} != cos_cache shape {tuple(cos_cache.shape)}"
        )
    if 2 * half > head_dim:
        raise ValueError(f"cos_cache width {half} gives rotary_dim {2 * half} > head_dim {head_dim}")
    if q.shape[0] != positions.shape[0] or k.shape[0] != positions.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} tokens, q {q.shape[0]}, k {k.shape[0]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride(-1) != 1 or sin_cache.stride(-1) != 1:
        raise ValueError("q, k, cos_cache and sin_cache: the last axis must be contiguous")
    if q.shape[0] == 0:
        return q, k
    q3 = q.view(q.shape[0], -1, head_dim) if q.dim() == 2 else q
    k3 = k.view(k.shape[0], -1, head_dim) if k.dim() == 2 else k
    _rotary_kernel[(q.shape[0],)](
        positions,
        q3,
        k3,
        cos_cache,
        sin_cache,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        q3.shape[1],
        k3.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q3.shape[1]),
        BLOCK_KH=triton.next_power_of_2(k3.shape[1]),
        num_warps=4,
    )
    return q, k
