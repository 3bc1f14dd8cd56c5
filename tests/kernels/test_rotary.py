"""Neox rotary embedding, in place on q and k (kernels/qk_norm_rope.py with no norm and no pool store),
against the float32 reference (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.qk_norm_rope import qk_norm_rope_
from kernels.reference import qk_norm_rope_ref
from tests.kernels.conftest import rel_error


def _caches(rotary_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim"),
    [(4, 4, 32, 32), (8, 2, 16, 16), (6, 2, 32, 16)],  # MHA, GQA, partial rotary
)
def test_rotary_in_place_on_qkv_views_matches_reference(gen, heads, kv_heads, head_dim, rotary_dim) -> None:
    tokens = 9
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    v_before = v.clone()
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos, sin = _caches(rotary_dim, 512)
    ref_q, ref_k = qk_norm_rope_ref(positions, q, k, cos, sin, head_dim)
    qk_norm_rope_(positions, q, k, cos, sin, head_dim)
    assert rel_error(q, ref_q) < 1e-5
    assert rel_error(k, ref_k) < 1e-5
    assert torch.equal(v, v_before)


def test_position_zero_is_identity(gen) -> None:
    q = torch.randn((3, 64), generator=gen)
    k = torch.randn((3, 32), generator=gen)
    q0, k0 = q.clone(), k.clone()
    cos, sin = _caches(16, 8)
    qk_norm_rope_(torch.zeros(3, dtype=torch.int64), q, k, cos, sin, 16)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_cache_wider_than_head_is_rejected(gen) -> None:
    cos, sin = _caches(64, 8)
    with pytest.raises(ValueError, match="head_dim"):
        qk_norm_rope_(torch.zeros(1, dtype=torch.int64), torch.randn(1, 32), torch.randn(1, 32), cos, sin, 32)
