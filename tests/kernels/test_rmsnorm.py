"""RMSNorm and fused add + RMSNorm against the float32 reference, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import fused_add_rmsnorm_ref, rmsnorm_ref
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tests.kernels.conftest import poisoned, rel_error


@pytest.mark.parametrize(("rows", "hidden"), [(5, 64), (3, 100), (33, 16)])
def test_rmsnorm_matches_reference(gen, rows, hidden) -> None:
    x = torch.randn((rows, hidden), generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    out = rmsnorm(x, w, 1e-6, out=poisoned((rows, hidden)))
    assert rel_error(out, rmsnorm_ref(x, w, 1e-6)) < 1e-5


def test_fused_add_rmsnorm_returns_norm_of_sum_and_the_sum(gen) -> None:
    x = torch.randn((7, 96), generator=gen)
    residual = torch.randn((7, 96), generator=gen)
    w = torch.randn(96, generator=gen)
    normed, total = fused_add_rmsnorm(x, residual, w, 1e-5)
    ref_normed, ref_total = fused_add_rmsnorm_ref(x, residual, w, 1e-5)
    assert rel_error(normed, ref_normed) < 1e-5
    assert torch.equal(total, x + residual)


def test_per_head_norm_in_place_on_a_strided_view(gen) -> None:
    # Qwen3's q_norm: [tokens, heads, head_dim] inside the fused qkv output, normalized in place.
    tokens, heads, head_dim = 6, 4, 32
    qkv = torch.randn((tokens, (heads + 4) * head_dim), generator=gen)
    untouched = qkv[:, heads * head_dim :].clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    w = torch.randn(head_dim, generator=gen)
    ref = rmsnorm_ref(q, w, 1e-6)
    rmsnorm(q, w, 1e-6, out=q)
    assert rel_error(q, ref) < 1e-5
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_half_precision_rounding_follows_hugging_face(gen) -> None:
    # float16; bf16 rounding is checked on the GPU (bench/gpu_kernels.py), written while Triton 3.6's
    # interpreter truncated float32 -> bf16 (kernels/interpreter_compat.py now rounds to nearest).
    x = torch.randn((4, 64), generator=gen).half()
    residual = torch.randn((4, 64), generator=gen).half()
    w = (1 + 0.1 * torch.randn(64, generator=gen)).half()
    normed, total = fused_add_rmsnorm(x, residual, w, 1e-6)
    # Hugging Face adds in half precision, normalizes in float32, rounds, then scales by the weight.
    hf_total = x + residual
    h = hf_total.float()
    hf_normed = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert torch.equal(total, hf_total)
    # Only the float32 sum of squares may differ in its last bit (summation order).
    assert rel_error(normed, hf_normed) < 1e-3
    assert (normed != hf_normed).float().mean() < 0.05


def test_mismatched_residual_is_rejected(gen) -> None:
    x = torch.randn((2, 8), generator=gen)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(x, torch.randn((2, 9), generator=gen), torch.ones(8), 1e-6)


@pytest.mark.parametrize("with_residual", [False, True])
def test_zero_centered_matches_the_qwen35_torch_norm(gen, with_residual) -> None:
    # Qwen3.5's norms scale by (1 + weight) and stay in float32 until one final rounding: the kernel's
    # zero-centered form against ZeroCenteredRMSNorm's torch form (what runs on the CPU).
    from services.worker.runtime.layers.layernorm import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(80, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(80, generator=gen))
    x = torch.randn((9, 80), generator=gen) * 2
    if with_residual:
        residual = torch.randn((9, 80), generator=gen)
        normed, total = fused_add_rmsnorm(x, residual, norm.weight.data, 1e-6, zero_centered=True)
        ref_normed, ref_total = norm(x, residual)
        assert torch.equal(total, ref_total)
    else:
        normed, ref_normed = rmsnorm(x, norm.weight.data, 1e-6, zero_centered=True), norm(x)
    assert rel_error(normed, ref_normed) < 1e-5
    # Not the plain form: (1 + w) is not w.
    assert rel_error(rmsnorm(x, norm.weight.data, 1e-6), ref_normed) > 0.1
