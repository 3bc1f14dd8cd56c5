"""A float8 KV pool through the Triton kernels (interpreter) against the torch references.

Stores are compared bit for bit: the kernels quantize as services/worker/mem/memory_pool.py does
(x * (1 / scale) in float32, clipped, rounded to nearest even), and kernels/interpreter_compat.py makes
the interpreter's float8 conversions round as the GPU's do. Attention runs with float32 queries and
exact ("ieee") float32 dots, over float8 keys and values that convert to float32 exactly, so it matches
the float32 reference over the dequantized pool to float32 rounding (1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
)
from kernels.extend_attention import ExtendTiles, extend_attention, extend_block_table
from kernels.kv_store import store_kv
from kernels.qk_norm_rope import qk_norm_rope_
from kernels.reference import decode_attention_ref, extend_attention_ref, kv_store_ref, pool_values_ref
from services.worker.mem.memory_pool import quantize_kv
from tests.kernels.conftest import poisoned, rel_error

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
SMALL = ExtendTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _awkward_values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values across float8's whole range: ordinary ones, tiny ones (float8 subnormals and below),
    ones past the largest finite float8 (clipped), and exact rounding ties (17 lies between e4m3's 16
    and 18: ties go to the even 16)."""
    x = torch.randn(shape, generator=gen) * 4
    flat = x.view(-1)
    flat[0::7] *= 1e-3
    flat[1::11] *= 2e4
    flat[2::13] = 17.0
    return x.to(dtype)


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)], ids=["unit", "scaled"])
def test_store_kv_quantizes_bit_for_bit_as_the_torch_pool(gen, pool_dtype, src_dtype, scales) -> None:
    kv_heads, head_dim, tokens = 2, 16, 9
    k_buffer = torch.zeros((20, kv_heads, head_dim), dtype=pool_dtype)
    v_buffer = torch.zeros((20, kv_heads, head_dim), dtype=pool_dtype)
    k = _awkward_values(gen, (tokens, kv_heads * head_dim), src_dtype)
    v = _awkward_values(gen, (tokens, kv_heads * head_dim), src_dtype)
    loc = torch.randperm(19, generator=gen)[:tokens] + 1
    ref_k, ref_v = k_buffer.clone(), v_buffer.clone()
    kv_store_ref(ref_k, ref_v, loc, k, v, *scales)
    store_kv(k_buffer, v_buffer, loc, k, v, *scales)
    assert torch.equal(_bits(k_buffer), _bits(ref_k))
    assert torch.equal(_bits(v_buffer), _bits(ref_v))
    # The engine's torch path (memory_pool.quantize_kv) stores the same bits.
    assert torch.equal(
        _bits(k_buffer[loc]), _bits(quantize_kv(k.view(tokens, kv_heads, head_dim), scales[0], pool_dtype))
    )
    # And the values are what the type can hold: clipped, never inf or NaN.
    assert torch.isfinite(k_buffer.float()).all() and torch.isfinite(v_buffer.float()).all()
    if pool_dtype == torch.float8_e4m3fn and scales == (1.0, 1.0):
        assert k_buffer.float().abs().max() == 448.0  # the clipped values
        assert (k_buffer[loc].float().view(-1)[2::13] == 16.0).all()  # 17 rounds to even


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
def test_fused_prologue_stores_the_rotated_k_and_v_quantized(gen, pool_dtype) -> None:
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 7
    qkv = (3 * torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=gen)).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    k_buffer = torch.zeros((24, kv_heads, head_dim), dtype=pool_dtype)
    v_buffer = torch.zeros((24, kv_heads, head_dim), dtype=pool_dtype)
    loc = torch.randperm(23, generator=gen)[:tokens] + 1
    weight = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    qk_norm_rope_(
        torch.arange(tokens) * 3, q, k, freqs.cos(), freqs.sin(), head_dim, q_weight=weight, k_weight=weight,
        v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=loc, k_scale=0.5, v_scale=1.5,
    )  # fmt: skip
    # The pool holds the k the kernel left in place (rotated, in bfloat16), quantized as the store does.
    ref_k, ref_v = torch.zeros_like(k_buffer), torch.zeros_like(v_buffer)
    kv_store_ref(ref_k, ref_v, loc, k, v, 0.5, 1.5)
    assert torch.equal(_bits(k_buffer), _bits(ref_k))
    assert torch.equal(_bits(v_buffer), _bits(ref_v))


def _fp8_pool(kv, dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Turn a PagedKV's float32 pool into float8, as if its values had been stored with these scales."""
    kv.k_buffer = pool_values_ref(kv.k_buffer * 3, dtype, k_scale)
    kv.v_buffer = pool_values_ref(kv.v_buffer * 3, dtype, v_scale)


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(("seq_lens", "heads", "kv_heads"), [([1, 37, 80], 8, 2), ([130], 4, 4)])
def test_decode_over_a_float8_pool_matches_the_dequantized_reference(
    gen, paged_kv, pool_dtype, seq_lens, heads, kv_heads
) -> None:
    head_dim, max_splits, k_scale, v_scale = 32, 8, 0.8, 1.7
    kv = paged_kv(gen, seq_lens, kv_heads, head_dim)
    _fp8_pool(kv, pool_dtype, k_scale, v_scale)
    q = torch.randn((len(seq_lens), heads * head_dim), generator=gen)
    splits = kv_splits_per_request(kv.seq_lens, max_splits, min_tokens_per_split=16)
    assert int(splits.max()) > 1  # the merge of splits runs too
    part_out, part_lse = alloc_decode_partials(len(seq_lens), heads, max_splits, head_dim, "cpu")
    out = poisoned((len(seq_lens), heads * head_dim))
    decode_attention(
        q, kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, splits,
        max_splits, 0.2, part_out, part_lse, None, alloc_split_counters(len(seq_lens), kv_heads, "cpu"),
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    ref = decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, 0.2, k_scale, v_scale
    )
    assert rel_error(out, ref) < 1e-5
    # The scales matter: ignoring them gives another answer.
    unscaled = decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, 0.2
    )
    assert rel_error(unscaled, ref) > 0.1


def _extend(kv, q, k, v, prefix_lens, extend_lens, k_scale, v_scale):
    out = poisoned(q.shape)
    indptr = torch.tensor([0, *extend_lens]).cumsum(0).to(torch.int32)
    table = extend_block_table(prefix_lens, extend_lens, SMALL.block_m)
    extend_attention(
        q, k, v, out, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices,
        torch.tensor(prefix_lens, dtype=torch.int32), indptr, table, 0.25, SMALL, None,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
def test_extend_over_a_float8_pool_matches_the_dequantized_reference(gen, paged_kv, pool_dtype) -> None:
    heads, kv_heads, head_dim, k_scale, v_scale = 8, 2, 16, 1.3, 0.6
    prefix_lens, extend_lens = [21, 0, 40], [19, 33, 1]
    kv = paged_kv(gen, [p + e for p, e in zip(prefix_lens, extend_lens)], kv_heads, head_dim)
    _fp8_pool(kv, pool_dtype, k_scale, v_scale)
    q, k, v = (3 * torch.randn((sum(extend_lens), (heads + 2 * kv_heads) * head_dim), generator=gen)).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1
    )
    out = _extend(kv, q, k, v, prefix_lens, extend_lens, k_scale, v_scale)
    ref = extend_attention_ref(
        q, k, v, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, prefix_lens, extend_lens,
        0.25, k_scale, v_scale,
    )  # fmt: skip
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
def test_extend_attends_to_new_tokens_as_the_pool_holds_them(gen, paged_kv, pool_dtype) -> None:
    """A prompt prefilled in one step and the same prompt whose first part was stored by an earlier step
    (a chunk, or a radix-cache hit) give the same attention for the last part: the new tokens' K/V are
    rounded through float8 just as the stored prefix was."""
    heads, kv_heads, head_dim, k_scale, v_scale, n, split = 4, 2, 16, 0.9, 1.1, 45, 29
    kv = paged_kv(gen, [n], kv_heads, head_dim)
    kv.k_buffer = torch.zeros_like(kv.k_buffer, dtype=pool_dtype)
    kv.v_buffer = torch.zeros_like(kv.v_buffer, dtype=pool_dtype)
    q, k, v = (3 * torch.randn((n, (heads + 2 * kv_heads) * head_dim), generator=gen)).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1
    )
    slots = kv.req_to_token[int(kv.req_pool_indices[0]), :n].long()
    store_kv(kv.k_buffer, kv.v_buffer, slots, k, v, k_scale, v_scale)
    whole = _extend(kv, q, k, v, [0], [n], k_scale, v_scale)
    tail = _extend(kv, q[split:], k[split:], v[split:], [split], [n - split], k_scale, v_scale)
    assert rel_error(tail, whole[split:]) < 1e-6
