"""Rotary position embedding, neox style (rotate the two halves), applied in place to q and k.

cos_cache[p] = cos(p * inv_freq) and sin_cache[p] = sin(p * inv_freq) (any scaling already folded in),
each of width rotary_dim / 2 (rotary_dim <= head_dim; the channels past it pass through), as
services/worker/runtime/layers/rotary.py builds them. The rotation alone is the fused prologue kernel
(kernels/qk_norm_rope.py) with its norm and pool store switched off: one program per token rotates all
of its q heads and k heads, so cos and sin are read once per token and q/k are read and written once.
"""

from __future__ import annotations

import torch

from kernels.qk_norm_rope import qk_norm_rope_


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
    return qk_norm_rope_(positions, q, k, cos_cache, sin_cache, head_dim)
