"""The persistent batch-1 MLP block (kernels/persistent_mlp.py) against the two launches it replaces and a
float32 product, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvTiles, rmsnorm_gemv, silu_mul_gemv
from kernels.persistent_mlp import PersistentMlpTiles, counters, persistent_mlp
from tests.kernels.conftest import rel_error

TILES = PersistentMlpTiles(gate_up=GemvTiles(8, 32), down=GemvTiles(4, 32))


def _operands(gen: torch.Generator, hidden: int, inter: int, dtype: torch.dtype):
    x = torch.randn((1, hidden), generator=gen).to(dtype)
    res = torch.randn((1, hidden), generator=gen).to(dtype)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    w_gu = (torch.randn((2 * inter, hidden), generator=gen) / hidden**0.5).to(dtype)
    w_d = (torch.randn((hidden, inter), generator=gen) / inter**0.5).to(dtype)
    return x, res, norm_w, w_gu, w_d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (40, 52)], ids=["even", "ragged"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_block_is_rmsnorm_gemv_then_silu_mul_gemv_bit_for_bit(gen, dtype, hidden, inter, with_residual) -> None:
    x, res, norm_w, w_gu, w_d = _operands(gen, hidden, inter, dtype)
    res = res if with_residual else None
    y, res_out = persistent_mlp(x, res, norm_w, 1e-6, w_gu, w_d, TILES, grid=3)
    gu, two_res = rmsnorm_gemv(x, res, norm_w, 1e-6, w_gu, TILES.gate_up)
    two = silu_mul_gemv(gu, w_d, TILES.down)
    assert torch.equal(y, two)
    assert torch.equal(res_out, two_res)
    # And what the block computes, in float32.
    h = x.float() + (res.float() if res is not None else 0.0)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()
    g, u = (normed @ w_gu.float().t()).chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(g) * u) @ w_d.float().t()
    assert rel_error(y.float(), ref) < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("grid", [1, 4])
def test_every_launch_leaves_its_counters_at_zero(gen, grid) -> None:
    """The queue, done and leaving counters are put back by the last program out, so the next launch (or
    CUDA-graph replay) starts from task 0 and gives the same output."""
    x, res, norm_w, w_gu, w_d = _operands(gen, 64, 96, torch.float32)
    first = persistent_mlp(x, res, norm_w, 1e-6, w_gu, w_d, TILES, grid=grid)[0]
    assert counters(x.device).tolist() == [0, 0, 0]
    assert torch.equal(persistent_mlp(x, res, norm_w, 1e-6, w_gu, w_d, TILES, grid=grid)[0], first)


def test_bad_operands_get_a_clear_error(gen) -> None:
    x, res, norm_w, w_gu, w_d = _operands(gen, 64, 96, torch.float32)
    with pytest.raises(ValueError, match="down_weight must be"):
        persistent_mlp(x, res, norm_w, 1e-6, w_gu, w_d.t().contiguous(), TILES)
    with pytest.raises(ValueError, match="gate_up_weight takes 32 features"):
        persistent_mlp(x, res, norm_w, 1e-6, w_gu[:, :32].contiguous(), w_d, TILES)
    with pytest.raises(ValueError, match="x is torch.bfloat16"):
        persistent_mlp(x.bfloat16(), res.bfloat16(), norm_w, 1e-6, w_gu, w_d, TILES)
    with pytest.raises(ValueError, match="one contiguous row"):
        persistent_mlp(x.repeat(2, 1), res.repeat(2, 1), norm_w, 1e-6, w_gu, w_d, TILES)
    with pytest.raises(ValueError, match="norm_weight must be"):
        persistent_mlp(x, res, norm_w[:32], 1e-6, w_gu, w_d, TILES)


def test_the_llama_mlp_runs_the_block_in_one_launch_only_when_asked(gen, monkeypatch) -> None:
    """LlamaMLP.forward_normed on one row with "rows" GEMV tiles: under RS_PERSISTENT_MLP=1 the persistent
    launch, the same bits as the two fused-prologue launches it replaces; off by default; two rows, or a
    projection without tiles, keep the usual path."""
    import kernels.persistent_mlp as pm
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.layers.linear import load_gemv_kernels
    from services.worker.runtime.models.llama import LlamaMLP, persistent_mlp_fits

    load_gemv_kernels()
    mlp = LlamaMLP(64, 96, "silu")
    mlp.gate_up_proj.weight.data.copy_(torch.randn((192, 64), generator=gen) / 8)
    mlp.down_proj.weight.data.copy_(torch.randn((64, 96), generator=gen) / 10)
    mlp.gate_up_proj.gemv_tiles, mlp.down_proj.gemv_tiles = TILES.gate_up, TILES.down
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data.copy_(torch.rand(64, generator=gen) + 0.5)
    x, res = torch.randn((1, 64), generator=gen), torch.randn((1, 64), generator=gen)
    launches = []
    real = pm.persistent_mlp
    monkeypatch.setattr(pm, "persistent_mlp", lambda *a, **k: launches.append(1) or real(*a, **k))

    assert not persistent_mlp_fits(mlp, x)  # off by default
    two_launches = mlp.forward_normed(norm, x, res)
    monkeypatch.setenv("RS_PERSISTENT_MLP", "1")
    assert persistent_mlp_fits(mlp, x) and not persistent_mlp_fits(mlp, x.repeat(2, 1))
    one_launch = mlp.forward_normed(norm, x, res)
    assert launches == [1]
    assert torch.equal(one_launch[0], two_launches[0]) and torch.equal(one_launch[1], two_launches[1])
    mlp.down_proj.gemv_tiles = None
    assert not persistent_mlp_fits(mlp, x)
