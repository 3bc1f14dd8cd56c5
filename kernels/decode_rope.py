"""The fused prologue of decode attention: q/k norm, rotary and the new tokens' KV store in its launch.

At batch 1 a decode step is bound by its launches (~170 for Qwen3-0.6B), and kernels/qk_norm_rope.py's
launch before each layer's attention is one program's worth of work. With a DecodeRope,
kernels/decode_attention.py's kernel does it instead: each program normalizes and rotates its own GQA
group's q heads (kernels/qk_norm_rope.py's `rope_heads`, the same arithmetic, so the same bits), and the
program whose split holds a request's new position normalizes, rotates and stores that token's K/V head
(`store_new_kv`) before its loop reads the pool. Other programs never read that position, as long as each
row of the batch is its own request's one new token: rows of one request (speculative verification) read
each other's new tokens, which other programs of the launch would store, so the backend then keeps the
prologue a launch of its own (AttentionBackend.decode_rows_share_requests).

This module holds the host side: the operands and their checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# RS_ROPE_IN_DECODE=0 keeps decode's q/k norm, rotary and KV store a launch of their own (for A/B runs).
ROPE_IN_DECODE_ENV = "RS_ROPE_IN_DECODE"


@dataclass(frozen=True)
class DecodeRope:
    """decode_attention's fused prologue (kernels/qk_norm_rope.py's qk_norm_rope_ for a decode batch):
    q is passed un-rotated; each request's new token has position positions[i], its k and v rows
    ([bs, kv_heads * head_dim] views, e.g. of a fused qkv output) are normalized (q_weight / k_weight, both
    or neither), rotated with cos_cache / sin_cache [max_position, head_dim / 2] and stored at slot
    out_cache_loc[i] of the pool. Full rotary only (rotary_dim == head_dim, a power of two)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    out_cache_loc: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


def rope_fusable(head_dim: int, rotary_dim: int) -> bool:
    """Whether DecodeRope can take a layer's rotary: the whole head rotated, a power-of-two width."""
    return rotary_dim == head_dim and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_rope_for(
    head_dim: int,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary_emb: Any,
    out_cache_loc: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> DecodeRope | None:
    """A decode batch's DecodeRope for one layer (rotary_emb: its cos_cache / sin_cache tables), or None
    where the prologue stays a launch of its own: RS_ROPE_IN_DECODE=0, or a partial rotary."""
    if os.environ.get(ROPE_IN_DECODE_ENV, "1") == "0" or not rope_fusable(head_dim, 2 * rotary_emb.cos_cache.shape[-1]):
        return None
    return DecodeRope(positions, k, v, rotary_emb.cos_cache, rotary_emb.sin_cache, out_cache_loc, q_weight, k_weight, eps)


def rope_operands(
    rope: DecodeRope | None, batch_size: int, num_kv_heads: int, head_dim: int, q3: torch.Tensor
) -> DecodeRope:
    """rope checked, with k and v as [bs, kv_heads, head_dim] views; without one, stand-ins the kernel
    never reads (ROPE is off)."""
    if rope is None:
        return DecodeRope(q3[:, 0, 0], q3, q3, q3[:, 0], q3[:, 0], q3[:, 0, 0], q3, q3)
    half = rope.cos_cache.shape[-1]
    if not rope_fusable(head_dim, 2 * half) or rope.sin_cache.shape != rope.cos_cache.shape:
        raise ValueError(
            f"rope: cos/sin caches {tuple(rope.cos_cache.shape)} / {tuple(rope.sin_cache.shape)} must rotate the "
            f"whole head ({head_dim}, a power of two)"
        )
    if rope.cos_cache.stride(-1) != 1 or rope.sin_cache.stride(-1) != 1:
        raise ValueError("rope: cos_cache and sin_cache: the last axis must be contiguous")
    if (rope.q_weight is None) != (rope.k_weight is None):
        raise ValueError("rope: q_weight and k_weight: pass both (per-head RMSNorm) or neither")
    for name, w in (("q_weight", rope.q_weight), ("k_weight", rope.k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"rope: {name} must be a contiguous [{head_dim}] tensor, got {tuple(w.shape)}")
    for name, t in (("positions", rope.positions), ("out_cache_loc", rope.out_cache_loc)):
        if t.shape != (batch_size,):
            raise ValueError(f"rope: {name} must be [{batch_size}], got shape {tuple(t.shape)}")
    views = []
    for name, t in (("k", rope.k), ("v", rope.v)):
        if t.dim() != 2 or t.shape != (batch_size, num_kv_heads * head_dim) or t.stride(1) != 1:
            raise ValueError(
                f"rope: {name} must be [{batch_size}, {num_kv_heads * head_dim}] with a contiguous last axis, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
        views.append(t.view(batch_size, num_kv_heads, head_dim))
    weights = (rope.q_weight, rope.k_weight) if rope.q_weight is not None else (q3, q3)
    return DecodeRope(
        rope.positions,
        views[0],
        views[1],
        rope.cos_cache,
        rope.sin_cache,
        rope.out_cache_loc,
        weights[0],
        weights[1],
        rope.eps,
    )
