"""The batched decode's quantization folded into the step before it (kernels/fp8_quant.py): RMSNorm (with
the residual add) or SiLU-and-mul, then the rows' per-128-column e4m3 quantization, in one launch. Each
must give the bits the two launches give (kernels/rmsnorm.py or kernels/activation.py, then
per_token_group_quant_fp8), which the w8a8 GEMM then reads; run here under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.fp8_gemm import GEMV_MAX_ROWS
from kernels.fp8_quant import per_token_group_quant_fp8, rmsnorm_group_quant_fp8, silu_mul_group_quant_fp8
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

EPS = 1e-6


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# Rows of 640 (the norm's tile holds 2 rows, the last one masked at 17 rows) and 2,048 (one row a tile).
@pytest.mark.parametrize(("m", "k"), [(17, 640), (3, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_then_quant_in_one_launch_gives_the_two_launches_bits(
    gen, m, k, dtype, with_residual
) -> None:
    # Rows of very different sizes, so each row's norm and each group's scale matter.
    x = (torch.randn((m, k), generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    residual = torch.randn((m, k), generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    q, scale, res_out = rmsnorm_group_quant_fp8(x, residual, weight, EPS)
    if with_residual:
        normed, want_res = fused_add_rmsnorm(x, residual, weight, EPS)
        assert _same(res_out, want_res)
    else:
        normed = rmsnorm(x, weight, EPS)
        assert res_out is x
    want_q, want_scale = per_token_group_quant_fp8(normed, 128)
    assert _same(q, want_q) and _same(scale, want_scale)


# 1,536 columns: a full 1,024-column program and a half one; 256: one program of several rows.
@pytest.mark.parametrize(("m", "k"), [(20, 1536), (5, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_then_quant_in_one_launch_gives_the_two_launches_bits(gen, m, k, dtype) -> None:
    gate_up = (torch.randn((m, 2 * k), generator=gen) * 3).to(dtype)
    q, scale = silu_mul_group_quant_fp8(gate_up)
    want_q, want_scale = per_token_group_quant_fp8(silu_and_mul(gate_up), 128)
    assert _same(q, want_q) and _same(scale, want_scale)
    # [gate | up] in that order: the halves swapped quantize another activation.
    swapped = torch.cat([gate_up[:, k:], gate_up[:, :k]], dim=1)
    assert not _same(silu_mul_group_quant_fp8(swapped)[0], q)


def test_what_the_fused_quantizers_refuse(gen) -> None:
    x = torch.randn((4, 200), generator=gen)
    with pytest.raises(ValueError, match="multiple of 128"):
        rmsnorm_group_quant_fp8(x, None, torch.ones(200), EPS)
    with pytest.raises(ValueError, match="multiple of 256"):
        silu_mul_group_quant_fp8(torch.randn((4, 384), generator=gen))
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_mul_group_quant_fp8(torch.randn((512, 4), generator=gen).t())
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm_group_quant_fp8(torch.randn((4, 256), generator=gen), None, torch.ones(128), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        rmsnorm_group_quant_fp8(
            torch.randn((4, 256), generator=gen), torch.randn((3, 256)), torch.ones(256), EPS
        )


def test_the_layers_few_rows_bound_is_the_gemms() -> None:
    from services.worker.runtime.layers.fp8 import FEW_ROWS_MAX

    assert FEW_ROWS_MAX == GEMV_MAX_ROWS
