"""The Gated DeltaNet layer's fused decode kernels against its torch reference (layers/gdn_ops.py), under
the Triton interpreter: the decode update that forms g and beta from the raw a and b in the kernel
(fused_sigmoid_gating_delta_rule_update), and the one-pass gated RMSNorm (kernels/gated_rms_norm.py).

Half precision: float16 pins the rounding points down (the interpreter rounds float32 -> float16 to
nearest, as the GPU does), so results match the reference nearly bit for bit. bfloat16 gets a few ulps,
set while Triton 3.6's interpreter truncated float32 -> bfloat16 (kernels/interpreter_compat.py now
rounds to nearest, as the GPU does): loose bounds."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import fused_sigmoid_gating_delta_rule_update
from kernels.gated_rms_norm import gated_rms_norm
from services.worker.runtime.layers import gdn_ops
from services.worker.runtime.layers.gated_delta_net import GatedRMSNorm
from tests.kernels.conftest import rel_error
from tests.kernels.test_gdn_kernels import DV, HV, SCALE, gdn_inputs, state_pool

# a + dt_bias across softplus' range: log1p(exp(x)) far below 0 (where log(1 + exp(x)) would lose it),
# near 0, just either side of the threshold 20, and far above it (exp(x) overflows float32 past 88).
SOFTPLUS_X = [-30.0, -3.0, 0.5, 19.5, 20.5, 100.0, 1000.0]


def raw_gates(gen: torch.Generator, batch: int, dtype: torch.dtype = torch.float32):
    """a, b as strided column slices of one projection (as the layer splits in_proj), A_log, dt_bias.
    A_log spans decays from gentle to strong, so that g for large a + dt_bias still leaves a state."""
    proj = torch.randn((batch, 3 * HV), generator=gen).to(dtype)
    b, a = proj[:, HV : 2 * HV], proj[:, 2 * HV :]
    dt_bias = torch.randn(HV, generator=gen)
    x = torch.tensor(SOFTPLUS_X)[torch.randint(len(SOFTPLUS_X), (batch, HV), generator=gen)]
    a.copy_(x - dt_bias)
    a_log = torch.tensor([-9.0, -4.0, -1.0, 0.5])
    return a, b.mul_(3), a_log, dt_bias


@pytest.mark.parametrize(
    "indices",
    [[2], [4, 2, 5], [4, 2, 5, 1, 0, 0]],  # the last pads the batch with the spare row 0, as CUDA graphs do
    ids=["batch1", "batch3", "batch6-padded"],
)
def test_fused_gating_update_matches_unfused_torch(gen, indices: list[int]) -> None:
    batch, real = len(indices), len([i for i in indices if i != 0])
    q, k, v, _, _ = gdn_inputs(gen, batch)
    a, b, a_log, dt_bias = raw_gates(gen, batch)
    pool = state_pool(gen, 6)
    ref_pool = pool.clone()
    idx = torch.tensor(indices, dtype=torch.int32)
    before = pool.clone()
    o = fused_sigmoid_gating_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, state=pool, state_indices=idx, scale=SCALE
    )
    g, beta = gdn_ops.sigmoid_gating(a[:real], b[:real], a_log, dt_bias)
    assert torch.isfinite(g).all() and (g < -1.0).any()  # the large x did decay the state
    ref_o = gdn_ops.fused_recurrent_gated_delta_rule_update(
        q[:real], k[:real], v[:real], g, beta, state=ref_pool, state_indices=idx[:real], scale=SCALE
    )
    torch.testing.assert_close(o[:real], ref_o, rtol=1e-5, atol=1e-5)
    written = sorted(set(indices) - {0})
    torch.testing.assert_close(pool[written], ref_pool[written], rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(1, 6) if r not in written]
    assert torch.equal(pool[untouched], before[untouched])


def test_fused_gating_decays_the_state_by_exp_g(gen) -> None:
    # With b = -60 (beta ~1e-26) the update only decays: state after / before is exp(g).
    q, k, v, _, _ = gdn_inputs(gen, 2)
    a, b, a_log, dt_bias = raw_gates(gen, 2)
    b.fill_(-60.0)
    pool = state_pool(gen, 3)
    before = pool.clone()
    fused_sigmoid_gating_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, state=pool, state_indices=torch.tensor([2, 1]), scale=SCALE
    )
    g, _ = gdn_ops.sigmoid_gating(a, b, a_log, dt_bias)
    expected = before[[2, 1]] * g.exp()[:, :, None, None]
    torch.testing.assert_close(pool[[2, 1]], expected, rtol=1e-5, atol=1e-20)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_gating_update_half_precision_matches_torch(gen, dtype: torch.dtype) -> None:
    q, k, v, _, _ = gdn_inputs(gen, 3, dtype)
    a, b, a_log, dt_bias = raw_gates(gen, 3, dtype)
    a_log, dt_bias = a_log.to(dtype), dt_bias.to(dtype)
    pool = state_pool(gen, 4)
    ref_pool = pool.clone()
    idx = torch.tensor([3, 1, 2], dtype=torch.int32)
    o = fused_sigmoid_gating_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, state=pool, state_indices=idx, scale=SCALE
    )
    ref_o = gdn_ops.fused_sigmoid_gating_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, state=ref_pool, state_indices=idx, scale=SCALE
    )
    assert o.dtype == dtype
    if dtype == torch.float16:  # beta rounded to float16 as b.sigmoid() is: the states agree in float32
        torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o, ref_o, rtol=1e-3, atol=1e-3)
    else:  # beta (and the output) may be an ulp toward zero, 2^-8 relative
        assert rel_error(pool, ref_pool) < 1e-2 and rel_error(o, ref_o) < 1e-2


def test_fused_gating_bad_arguments_are_rejected(gen) -> None:
    q, k, v, _, _ = gdn_inputs(gen, 2)
    a, b, a_log, dt_bias = raw_gates(gen, 2)
    pool, idx = state_pool(gen, 3), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"a must be a floating-point \[2, 4\]"):
        fused_sigmoid_gating_delta_rule_update(q, k, v, a[:, :3], b, a_log, dt_bias, state=pool,
                                               state_indices=idx, scale=SCALE)  # fmt: skip
    with pytest.raises(ValueError, match=r"dt_bias must be a contiguous floating-point \[4\]"):
        fused_sigmoid_gating_delta_rule_update(q, k, v, a, b, a_log, dt_bias[:2], state=pool,
                                               state_indices=idx, scale=SCALE)  # fmt: skip


# --- gated RMSNorm ---------------------------------------------------------------------------------


def norm_inputs(gen: torch.Generator, tokens: int, dtype: torch.dtype):
    """x [T, Hv, Dv] and the gate as a strided view of a wider projection (the layer's z)."""
    x = torch.randn((tokens, HV, DV), generator=gen).to(dtype) * 3
    proj = torch.randn((tokens, HV * DV + 5), generator=gen).to(dtype)
    return x, proj[:, : HV * DV].view(tokens, HV, DV)


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),  # weight * normed rounded to float16
        (torch.float16, torch.float32),  # ... and not rounded
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_gated_rms_norm_matches_the_module(gen, dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    x, gate = norm_inputs(gen, 3, dtype)
    norm = GatedRMSNorm(DV, 1e-6).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen) + 1)
        ref = norm(x, gate)  # gdn_ops' torch form
    out = gated_rms_norm(x, gate, norm.weight.detach(), norm.eps)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    elif dtype == torch.float16:  # the same rounding points: a last-bit float32 difference may tip one
        torch.testing.assert_close(out, ref, rtol=2**-10, atol=1e-5)
        assert (out == ref).float().mean() > 0.97
    else:  # three rounding points (a bound from when the interpreter truncated to bfloat16)
        torch.testing.assert_close(out, ref, rtol=3 * 2**-7, atol=1e-5)
    # 2-D rows of head_dim give the same values.
    torch.testing.assert_close(gated_rms_norm(x.reshape(-1, DV), gate.reshape(-1, DV), norm.weight.detach(),
                                              norm.eps), out.reshape(-1, DV), rtol=0, atol=0)  # fmt: skip


def test_gated_rms_norm_bad_arguments_are_rejected(gen) -> None:
    x, gate = norm_inputs(gen, 2, torch.float32)
    with pytest.raises(ValueError, match="gate shape"):
        gated_rms_norm(x, gate[:1], torch.ones(DV), 1e-6)
    with pytest.raises(ValueError, match="last dimension 16 != weight size 8"):
        gated_rms_norm(x, gate, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16"):
        gated_rms_norm(x.double(), gate.double(), torch.ones(DV), 1e-6)

