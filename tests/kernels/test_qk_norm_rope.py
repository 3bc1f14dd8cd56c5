"""Fused per-head q/k RMSNorm + neox rotary + KV-pool store, against the unfused torch reference
(Triton interpreter).

Tolerances, measured at the size of each head's values (the rotation can make an output smaller than
the inputs whose rounding it carries):
- float32: 1e-6. The kernel sums mean(x^2) in another order than torch, which moves the last bit.
- float16: one ulp (2^-10), and nearly every element identical to the reference rounded to float16: the
  interpreter rounds float32 -> float16 to nearest as the GPU does, so this pins the rounding points
  (normalized value, times weight, rotated output) down; only a last-bit float32 difference may tip one.
- bfloat16: four ulps (4 * 2^-7), set while Triton 3.6's interpreter truncated float32 -> bfloat16 (each
  of the three rounding points a whole ulp off toward zero). kernels/interpreter_compat.py now rounds it
  to nearest as the GPU does, so this bound is loose.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kernels.qk_norm_rope import qk_norm_rope_
from kernels.reference import kv_store_ref, qk_norm_rope_ref
from tests.kernels.conftest import rotary_caches

EPS = 1e-6
TOKENS = 7
NUM_SLOTS = 24




# Largest error allowed, relative to the largest value in the head (see the module docstring).
_TOLERANCE = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 4 * 2.0**-7}


def _assert_close_per_head(out: torch.Tensor, ref: torch.Tensor, head_dim: int) -> None:
    dtype = out.dtype
    out = out.float().reshape(out.shape[0], -1, head_dim)
    ref = ref.reshape(out.shape)
    scale = ref.abs().amax(dim=-1, keepdim=True)
    err = (out - ref).abs()
    assert (err <= _TOLERANCE[dtype] * scale).all(), f"max error {(err / scale).max().item():.3g} of the head's scale"
    if dtype == torch.float16:
        exact = (out == ref.to(dtype).float()).float().mean().item()
        assert exact >= 0.95, f"only {exact:.1%} of the elements round as the reference does"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim"),
    [(4, 4, 32, 32), (8, 2, 16, 16), (6, 2, 32, 16)],  # MHA, GQA, partial rotary
)
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("with_pool", [True, False], ids=["store", "no_store"])
def test_fused_prologue_on_qkv_views_matches_unfused_reference(
    gen, dtype, heads, kv_heads, head_dim, rotary_dim, with_norm, with_pool
) -> None:
    qkv = (2 * torch.randn((TOKENS, (heads + 2 * kv_heads) * head_dim), generator=gen)).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    v_before = v.clone()
    positions = torch.randint(0, 500, (TOKENS,), generator=gen)
    cos, sin = rotary_caches(rotary_dim, 512)
    q_weight = k_weight = None
    if with_norm:
        q_weight = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
        k_weight = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    ref_q, ref_k = qk_norm_rope_ref(positions, q, k, cos, sin, head_dim, q_weight, k_weight, EPS)
    pool: dict[str, torch.Tensor] = {}
    if with_pool:
        pool["k_buffer"] = torch.randn((NUM_SLOTS, kv_heads, head_dim), generator=gen).to(dtype)
        pool["v_buffer"] = torch.randn((NUM_SLOTS, kv_heads, head_dim), generator=gen).to(dtype)
        pool["out_cache_loc"] = torch.randperm(NUM_SLOTS, generator=gen)[:TOKENS]
        ref_k_buffer, ref_v_buffer = pool["k_buffer"].clone(), pool["v_buffer"].clone()
        pool["v"] = v

    out = qk_norm_rope_(
        positions, q, k, cos, sin, head_dim, q_weight=q_weight, k_weight=k_weight, eps=EPS, **pool
    )

    assert out[0] is q and out[1] is k
    _assert_close_per_head(q, ref_q, head_dim)
    _assert_close_per_head(k, ref_k, head_dim)
    assert torch.equal(v, v_before)
    if with_pool:
        # The pool holds exactly the k the kernel left in place (as the unfused store would copy it),
        # and v; every other slot is untouched.
        kv_store_ref(ref_k_buffer, ref_v_buffer, pool["out_cache_loc"], k, v)
        assert torch.equal(pool["k_buffer"], ref_k_buffer)
        assert torch.equal(pool["v_buffer"], ref_v_buffer)


def test_store_casts_to_the_pool_dtype(gen) -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = torch.randn((TOKENS, (heads + 2 * kv_heads) * head_dim), generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    k_buffer = torch.zeros((NUM_SLOTS, kv_heads, head_dim), dtype=torch.float32)
    v_buffer = torch.zeros((NUM_SLOTS, kv_heads, head_dim), dtype=torch.float32)
    loc = torch.randperm(NUM_SLOTS, generator=gen)[:TOKENS]
    cos, sin = rotary_caches(head_dim, 64)
    weight = torch.ones(head_dim, dtype=torch.bfloat16)
    positions = torch.arange(TOKENS) * 5
    qk_norm_rope_(
        positions, q, k, cos, sin, head_dim, q_weight=weight, k_weight=weight, eps=EPS,
        v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=loc,
    )
    assert torch.equal(k_buffer[loc], k.float().view(TOKENS, kv_heads, head_dim))
    assert torch.equal(v_buffer[loc], v.float().view(TOKENS, kv_heads, head_dim))


@torch.no_grad()
def test_norm_at_position_zero_is_hugging_faces_qwen3_rmsnorm(gen) -> None:
    # Position 0 rotates by nothing, so what is left is Qwen3RMSNorm over each head, HF's rounding
    # included (float16: the interpreter rounds it to nearest, as the GPU does).
    head_dim = 16
    q = torch.randn((3, 4 * head_dim), generator=gen).half()
    k = torch.randn((3, 2 * head_dim), generator=gen).half()
    hf_norms = [Qwen3RMSNorm(head_dim, EPS).half() for _ in range(2)]
    for norm in hf_norms:
        norm.weight.copy_(1 + torch.randn(head_dim, generator=gen))
    expected = [norm(x.reshape(3, -1, head_dim)).reshape(x.shape) for norm, x in zip(hf_norms, (q, k))]
    cos, sin = rotary_caches(head_dim, 8)
    qk_norm_rope_(
        torch.zeros(3, dtype=torch.int64), q, k, cos, sin, head_dim,
        q_weight=hf_norms[0].weight, k_weight=hf_norms[1].weight, eps=EPS,
    )
    for out, ref in zip((q, k), expected):
        _assert_close_per_head(out, ref.float(), head_dim)


def _bad_call_kwargs(gen: torch.Generator) -> dict:
    head_dim = 16
    qkv = torch.randn((3, 8 * head_dim), generator=gen)
    cos, sin = rotary_caches(head_dim, 8)
    return dict(
        positions=torch.zeros(3, dtype=torch.int64),
        q=qkv[:, : 4 * head_dim],
        k=qkv[:, 4 * head_dim : 6 * head_dim],
        cos_cache=cos,
        sin_cache=sin,
        head_dim=head_dim,
        q_weight=torch.ones(head_dim),
        k_weight=torch.ones(head_dim),
        v=qkv[:, 6 * head_dim :],
        k_buffer=torch.zeros((8, 2, head_dim)),
        v_buffer=torch.zeros((8, 2, head_dim)),
        out_cache_loc=torch.tensor([1, 2, 3]),
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(head_dim=8), "rotary_dim 16"),
        (lambda a: a.update(sin_cache=a["sin_cache"][:, :4]), "cos_cache/sin_cache"),
        (lambda a: a.update(positions=a["positions"][:2]), "q: expected \\[2"),
        (lambda a: a.update(q=a["q"][:, :40]), "not a multiple of head_dim"),
        (lambda a: a.update(k=a["k"][:, ::2]), "k: the last axis must be contiguous"),
        (lambda a: a.update(k_weight=None), "q_weight and k_weight"),
        (lambda a: a.update(q_weight=torch.ones(8)), "q_weight: expected a contiguous \\[16\\]"),
        (lambda a: a.update(v_buffer=None), "pass all four"),
        (lambda a: a.update(v=a["v"][:, :16]), "v: shape"),
        (lambda a: a.update(out_cache_loc=torch.tensor([1, 2])), "out_cache_loc: expected \\[3\\]"),
        (lambda a: a.update(k_buffer=torch.zeros((8, 4, 16))), "k_buffer: expected \\[slots, 2, 16\\]"),
    ],
    ids=[
        "rotary_wider_than_head", "cos_sin_mismatch", "positions_count", "width_not_heads", "strided_cols",
        "one_weight", "weight_shape", "partial_pool", "v_shape", "loc_count", "buffer_heads",
    ],
)
def test_bad_arguments_are_clear_errors(gen, change, match) -> None:
    kwargs = _bad_call_kwargs(gen)
    change(kwargs)
    positions, q, k = kwargs.pop("positions"), kwargs.pop("q"), kwargs.pop("k")
    cos, sin, head_dim = kwargs.pop("cos_cache"), kwargs.pop("sin_cache"), kwargs.pop("head_dim")
    with pytest.raises(ValueError, match=match):
        qk_norm_rope_(positions, q, k, cos, sin, head_dim, **kwargs)
