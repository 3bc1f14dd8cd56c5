"""Storing new tokens' K/V into the pool (Triton interpreter)."""

from __future__ import annotations

import torch

from kernels.kv_store import store_kv
from kernels.reference import kv_store_ref


def test_store_kv_writes_exactly_the_given_slots(gen) -> None:
    kv_heads, head_dim, tokens = 2, 16, 5
    k_buffer = torch.randn((20, kv_heads, head_dim), generator=gen)
    v_buffer = torch.randn((20, kv_heads, head_dim), generator=gen)
    qkv = torch.randn((tokens, 6 * head_dim), generator=gen)
    k, v = qkv[:, 2 * head_dim : 4 * head_dim], qkv[:, 4 * head_dim :]  # strided views
    loc = torch.tensor([7, 1, 19, 3, 12])
    ref_k, ref_v = k_buffer.clone(), v_buffer.clone()
    kv_store_ref(ref_k, ref_v, loc, k, v)
    store_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer, ref_k)
    assert torch.equal(v_buffer, ref_v)


def test_store_kv_casts_to_the_pool_dtype(gen) -> None:
    k_buffer = torch.zeros((4, 1, 16), dtype=torch.float16)
    v_buffer = torch.zeros((4, 1, 16), dtype=torch.float16)
    k = torch.randn((2, 16), generator=gen)
    v = torch.randn((2, 16), generator=gen)
    store_kv(k_buffer, v_buffer, torch.tensor([2, 3]), k, v)
    assert torch.equal(k_buffer[2:, 0], k.half())
    assert torch.equal(v_buffer[2:, 0], v.half())
