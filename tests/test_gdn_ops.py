"""The Gated DeltaNet torch ops (layers/gdn_ops.py) against transformers' own references, sequence by
sequence: varlen batches over a state pool, with and without initial states, GQA (more v heads than
q/k heads), lengths around the chunk size; outputs and the states left in the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from services.worker.runtime.layers import gdn_ops

HK, HV, DK, DV = 2, 4, 16, 8
POOL_ROWS = 8
TOL = 1e-5


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("lengths", [[20], [5, 70, 1, 130], [64, 63, 65]], ids=str)
def test_chunked_rule_matches_transformers_per_sequence_with_initial_states(lengths: list[int]) -> None:
    total = sum(lengths)
    q, k, v = rand(total, HK, DK, seed=1), rand(total, HK, DK, seed=2), rand(total, HV, DV, seed=3)
    g, beta = -rand(total, HV, seed=4).abs(), rand(total, HV, seed=5).sigmoid()
    state = rand(POOL_ROWS, HV, DK, DV, seed=6)
    rows = torch.tensor([7, 2, 5, 1][: len(lengths)])
    initial = state.clone()
    cu = cu_seqlens(lengths)
    out = gdn_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, state=state, state_indices=rows, cu_seqlens=cu, scale=DK**-0.5
    )
    for i, row in enumerate(rows.tolist()):
        s, e = int(cu[i]), int(cu[i + 1])
        ref_out, ref_state = torch_chunk_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            initial_state=initial[row][None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert_close(out[s:e], ref_out[0])
        assert_close(state[row], ref_state[0])
    untouched = [r for r in range(POOL_ROWS) if r not in rows.tolist()]
    assert torch.equal(state[untouched], initial[untouched])


def test_chunked_rule_from_a_zero_state_matches_transformers_without_one() -> None:
    q, k, v = rand(33, HK, DK, seed=7), rand(33, HK, DK, seed=8), rand(33, HV, DV, seed=9)
    g, beta = -rand(33, HV, seed=10).abs(), rand(33, HV, seed=11).sigmoid()
    state = torch.zeros(2, HV, DK, DV)
    out = gdn_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, state=state, state_indices=torch.tensor([1]), cu_seqlens=cu_seqlens([33]),
        scale=DK**-0.5,
    )
    ref_out, _ = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm_in_kernel=True
    )
    assert_close(out, ref_out[0])


def test_recurrent_update_matches_transformers_one_token_per_sequence() -> None:
    q, k, v = rand(3, HK, DK, seed=12), rand(3, HK, DK, seed=13), rand(3, HV, DV, seed=14)
    g, beta = -rand(3, HV, seed=15).abs(), rand(3, HV, seed=16).sigmoid()
    state = rand(POOL_ROWS, HV, DK, DV, seed=17)
    rows = torch.tensor([4, 0, 6])
    initial = state.clone()
    out = gdn_ops.fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, state=state, state_indices=rows, scale=DK**-0.5
    )
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=initial[rows],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert_close(out, ref_out[:, 0])
    assert_close(state[rows], ref_state)


def test_chunked_prefill_then_decodes_equal_one_recurrent_pass() -> None:
    """A sequence split into an extend of 9, one of 5, then 3 decodes leaves the state and outputs of
    transformers' token-by-token recurrence over all 17 tokens."""
    n = 17
    q, k, v = rand(n, HK, DK, seed=18), rand(n, HK, DK, seed=19), rand(n, HV, DV, seed=20)
    g, beta = -rand(n, HV, seed=21).abs(), rand(n, HV, seed=22).sigmoid()
    state = torch.zeros(2, HV, DK, DV)
    row = torch.tensor([1])
    outs = []
    for s, e in ((0, 9), (9, 14)):
        outs.append(gdn_ops.chunk_gated_delta_rule(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state=state, state_indices=row,
            cu_seqlens=cu_seqlens([e - s]), scale=DK**-0.5,
        ))
    for t in range(14, n):
        outs.append(gdn_ops.fused_recurrent_gated_delta_rule_update(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state=state,
            state_indices=row, scale=DK**-0.5,
        ))
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_close(torch.cat(outs), ref_out[0])
    assert_close(state[1], ref_state[0])


def naive_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x [L, C] after `previous` [C, W-1] inputs, SiLU: F.conv1d."""
    full = torch.cat((previous, x.T), dim=-1)[None]
    return F.silu(F.conv1d(full, weight[:, None], bias, groups=x.shape[1]))[0].T


def test_causal_conv1d_fwd_matches_conv1d_with_and_without_initial_state() -> None:
    channels, width, lengths = 12, 4, [5, 1, 2, 9]
    total = sum(lengths)
    x, weight, bias = rand(total, channels, seed=23), rand(channels, width, seed=24), rand(channels, seed=25)
    conv_state = rand(POOL_ROWS, channels, width - 1, seed=26)
    initial = conv_state.clone()
    rows = torch.tensor([3, 1, 6, 2])
    has_initial = torch.tensor([True, False, True, False])
    cu = cu_seqlens(lengths)
    y = gdn_ops.causal_conv1d_fwd(
        x, weight, bias, conv_state=conv_state, state_indices=rows, cu_seqlens=cu, has_initial_state=has_initial
    )
    for i, row in enumerate(rows.tolist()):
        s, e = int(cu[i]), int(cu[i + 1])
        previous = initial[row] if has_initial[i] else torch.zeros(channels, width - 1)
        assert_close(y[s:e], naive_conv(x[s:e], weight, bias, previous))
        # The last W-1 inputs, reaching back into the previous state for a sequence shorter than W-1.
        assert torch.equal(conv_state[row], torch.cat((previous, x[s:e].T), dim=-1)[:, -(width - 1) :])


def test_causal_conv1d_update_matches_transformers() -> None:
    channels, width = 12, 4
    x, weight, bias = rand(3, channels, seed=27), rand(channels, width, seed=28), rand(channels, seed=29)
    conv_state = rand(POOL_ROWS, channels, width - 1, seed=30)
    rows = torch.tensor([5, 2, 7])
    ref_state = conv_state[rows].clone()
    y = gdn_ops.causal_conv1d_update(x, weight, bias, conv_state=conv_state, state_indices=rows)
    ref = causal_conv1d_update(x[:, :, None], ref_state, weight, bias, "silu")[:, :, 0]
    assert_close(y, ref)
    assert torch.equal(conv_state[rows], ref_state)


def test_more_qk_heads_than_v_heads_is_refused() -> None:
    q = k = rand(2, 4, DK, seed=31)
    with pytest.raises(ValueError, match="multiple of q/k heads"):
        gdn_ops.fused_recurrent_gated_delta_rule_update(
            q, k, rand(2, 2, DV, seed=32), torch.zeros(2, 2), torch.ones(2, 2),
            state=torch.zeros(3, 2, DK, DV), state_indices=torch.tensor([1, 2]), scale=1.0,
        )


def test_sigmoid_gating_update_matches_transformers_gating_and_recurrence() -> None:
    # transformers' Qwen3.5 forms beta = b.sigmoid() and g = -exp(A_log) * softplus(a + dt_bias) from the
    # raw projections (in their dtype) before torch_recurrent_gated_delta_rule; softplus' threshold (20)
    # keeps a + dt_bias = 100 finite.
    q, k, v = rand(3, HK, DK, seed=33), rand(3, HK, DK, seed=34), rand(3, HV, DV, seed=35)
    a, b = (rand(3, HV, seed=36) * 4).bfloat16(), rand(3, HV, seed=37).bfloat16()
    a[0, 0] = 100.0
    a_log, dt_bias = rand(HV, seed=38) - 2, rand(HV, seed=39)
    state = rand(POOL_ROWS, HV, DK, DV, seed=40)
    rows = torch.tensor([5, 3, 1])
    initial = state.clone()
    out = gdn_ops.fused_sigmoid_gating_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, state=state, state_indices=rows, scale=DK**-0.5
    )
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert torch.isfinite(g).all()
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None].float(), initial_state=initial[rows],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert_close(out, ref_out[:, 0])
    assert_close(state[rows], ref_state)
