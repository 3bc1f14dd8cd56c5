"""Gated DeltaNet kernels (gated delta rule, causal conv1d) against naive per-token torch loops and
transformers' Qwen3.5 torch paths, under the Triton interpreter. Tiny head dims keep it fast; the
sequence lengths cross the 64-token chunk edge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kernels import causal_conv1d as conv
from kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
    recurrent_gated_delta_rule,
)
from tests.kernels.conftest import rel_error

HK, HV, DK, DV = 2, 4, 16, 16  # GQA: value heads 0, 1 read q/k head 0; heads 2, 3 read head 1
LENS = [1, 5, 70, 64]  # 70 crosses the 64-token chunk edge, 64 ends on it
SCALE = DK**-0.5


def gdn_inputs(gen: torch.Generator, tokens: int, dtype: torch.dtype = torch.float32):
    # Strided views of one fused projection, as the layer splits its conv output.
    qkv = torch.randn((tokens, 2 * HK * DK + HV * DV), generator=gen).to(dtype)
    q = qkv[:, : HK * DK].view(tokens, HK, DK)
    k = qkv[:, HK * DK : 2 * HK * DK].view(tokens, HK, DK)
    v = qkv[:, 2 * HK * DK :].view(tokens, HV, DV)
    # Mostly mild decay, with some steps strong enough to wipe the state (exp(g) underflows to 0).
    g = -F.softplus(torch.randn((tokens, HV), generator=gen)) * 0.5
    g[torch.rand((tokens, HV), generator=gen) < 0.02] = -120.0
    beta = torch.sigmoid(torch.randn((tokens, HV), generator=gen))
    return q, k, v, g, beta


def state_pool(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn((rows, HV, DK, DV), generator=gen) * 0.3


def naive_gdn(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, l2norm=True):
    """Token by token in float64: S = S*exp(g); delta = beta (v - k^T S); S += k delta^T; o = q^T S.
    Returns (o, the pool after the call)."""
    group = v.shape[1] // q.shape[1]
    qd = q.double().repeat_interleave(group, 1)
    kd = k.double().repeat_interleave(group, 1)
    if l2norm:
        qd = qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-6)
        kd = kd * torch.rsqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
    pool = state.double().clone()
    out = torch.zeros(v.shape, dtype=torch.float64)
    for i in range(len(cu_seqlens) - 1):
        s = pool[int(state_indices[i])].clone()
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            s = s * g[t].double().exp()[:, None, None]
            kv = torch.einsum("hk,hkv->hv", kd[t], s)
            delta = (v[t].double() - kv) * beta[t].double()[:, None]
            s = s + kd[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", qd[t] * scale, s)
        pool[int(state_indices[i])] = s
    return out, pool


def varlen(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


# The token-by-token kernel is slow under the interpreter: it gets shorter sequences.
@pytest.mark.parametrize(
    ("kernel", "lens"), [(chunk_gated_delta_rule, LENS), (recurrent_gated_delta_rule, [1, 5, 9, 3])]
)
def test_varlen_prefill_matches_naive_recurrence(gen, kernel, lens) -> None:
    cu = varlen(lens)
    q, k, v, g, beta = gdn_inputs(gen, int(cu[-1]))
    pool = state_pool(gen, 9)
    pool[[2, 6]] = 0  # two sequences start from an empty state
    indices = torch.tensor([6, 0, 3, 2], dtype=torch.int32)
    ref_o, ref_pool = naive_gdn(q, k, v, g, beta, pool, indices, cu, SCALE)
    o = kernel(q, k, v, g, beta, state=pool, state_indices=indices, cu_seqlens=cu, scale=SCALE)
    assert rel_error(o, ref_o) < 1e-4
    for row in range(9):  # written rows hold the final states, the others are untouched
        assert rel_error(pool[row], ref_pool[row]) < 1e-4 or torch.equal(pool[row], ref_pool[row].float())


def test_chunked_prefill_matches_transformers(gen) -> None:
    # transformers' chunked and recurrent torch paths, one batch of two equal-length sequences.
    lens = [70, 70]
    q, k, v, g, beta = gdn_inputs(gen, sum(lens))
    pool = state_pool(gen, 2)
    initial = pool.clone()
    o = chunk_gated_delta_rule(q, k, v, g, beta, state=pool, state_indices=torch.tensor([1, 0], dtype=torch.int32),
                               cu_seqlens=varlen(lens), scale=SCALE)  # fmt: skip
    batched = [x.reshape(2, 70, *x.shape[1:]) for x in (q, k, v, g, beta)]
    for hf in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref_o, ref_state = hf(*batched, initial_state=initial[[1, 0]], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert rel_error(o, ref_o.reshape(o.shape)) < 1e-4
        assert rel_error(pool[[1, 0]], ref_state) < 1e-4


def test_prefill_then_decode_continues_the_recurrence(gen) -> None:
    # Prefill 70 tokens with the chunked kernel, then decode three tokens: the same as one recurrence.
    q, k, v, g, beta = gdn_inputs(gen, 73)
    pool = state_pool(gen, 3)
    idx = torch.tensor([1], dtype=torch.int32)
    ref_o, ref_pool = naive_gdn(q, k, v, g, beta, pool, idx, varlen([73]), SCALE)
    outs = [chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], state=pool, state_indices=idx,
                                   cu_seqlens=varlen([70]), scale=SCALE)]  # fmt: skip
    for t in range(70, 73):
        s = slice(t, t + 1)
        outs.append(fused_recurrent_gated_delta_rule_update(q[s], k[s], v[s], g[s], beta[s], state=pool,
                                                            state_indices=idx, scale=SCALE))  # fmt: skip
    assert rel_error(torch.cat(outs), ref_o) < 1e-4
    assert rel_error(pool, ref_pool) < 1e-4


def test_decode_update_with_padded_rows(gen) -> None:
    # Rows 3 and 4 are batch padding: one points at the pool's spare row 0, one is negative (no state).
    q, k, v, g, beta = gdn_inputs(gen, 5)
    pool = state_pool(gen, 6)
    indices = torch.tensor([4, 2, 5, 0, -1], dtype=torch.int32)
    ref_o, ref_pool = naive_gdn(
        q[:3], k[:3], v[:3], g[:3], beta[:3], pool, indices[:3], varlen([1, 1, 1]), SCALE
    )
    before = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, state=pool, state_indices=indices, scale=SCALE
    )
    assert rel_error(o[:3], ref_o) < 1e-4
    assert rel_error(pool[[4, 2, 5]], ref_pool[[4, 2, 5]]) < 1e-4
    assert torch.equal(pool[[1, 3]], before[[1, 3]])
    zero_state, _ = naive_gdn(q[4:], k[4:], v[4:], g[4:], beta[4:], torch.zeros(1, HV, DK, DV),
                              torch.tensor([0]), varlen([1]), SCALE)  # fmt: skip
    assert rel_error(o[4:], zero_state) < 1e-4  # the negative row ran from a zero state


def test_decode_update_matches_transformers_recurrent(gen) -> None:
    q, k, v, g, beta = gdn_inputs(gen, 3)
    pool = state_pool(gen, 3)
    initial = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state=pool, state_indices=torch.arange(3),
                                                scale=SCALE)  # fmt: skip
    ref_o, ref_state = torch_recurrent_gated_delta_rule(*(x.unsqueeze(1) for x in (q, k, v, g, beta)),
                                                        initial_state=initial, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert rel_error(o, ref_o[:, 0]) < 1e-4
    assert rel_error(pool, ref_state) < 1e-4


@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule_update])
def test_bf16_inputs_and_no_l2norm(gen, kernel) -> None:
    lens = [70, 3] if kernel is chunk_gated_delta_rule else [1, 1, 1]
    cu = varlen(lens)
    q, k, v, g, beta = gdn_inputs(gen, int(cu[-1]), torch.bfloat16)
    q, k = q * 0.25, k * 0.25  # unnormalised keys must keep the recurrence stable
    pool = state_pool(gen, len(lens))
    idx = torch.arange(len(lens), dtype=torch.int32)
    ref_o, ref_pool = naive_gdn(q, k, v, g, beta, pool, idx, cu, 0.5, l2norm=False)
    extra = {"cu_seqlens": cu} if kernel is chunk_gated_delta_rule else {}
    o = kernel(q, k, v, g, beta, state=pool, state_indices=idx, scale=0.5, use_qk_l2norm=False, **extra)
    assert o.dtype == torch.bfloat16
    assert rel_error(o, ref_o) < 1e-2
    assert rel_error(pool, ref_pool) < 1e-3


def test_gdn_bad_shapes_are_rejected(gen) -> None:
    q, k, v, g, beta = gdn_inputs(gen, 4)
    pool = state_pool(gen, 4)
    idx, cu = torch.arange(4, dtype=torch.int32), varlen([4])
    with pytest.raises(ValueError, match="multiple of the key heads"):  # 3 value heads for 2 q/k heads
        fused_recurrent_gated_delta_rule_update(q, k, v[:, :3], g[:, :3].contiguous(), beta[:, :3].contiguous(),
                                                state=pool[:, :3], state_indices=idx, scale=SCALE)  # fmt: skip
    with pytest.raises(ValueError, match="g must be a contiguous float32"):
        chunk_gated_delta_rule(q, k, v, g.half(), beta, state=pool, state_indices=idx[:1], cu_seqlens=cu,
                               scale=SCALE)  # fmt: skip
    with pytest.raises(ValueError, match="state must be a float32 pool"):
        chunk_gated_delta_rule(q, k, v, g, beta, state=pool.half(), state_indices=idx[:1], cu_seqlens=cu,
                               scale=SCALE)  # fmt: skip


# --- causal conv1d ---------------------------------------------------------------------------------

CH, WIDTH = 24, 4


def naive_conv(x, weight, bias, conv_state, state_indices, cu_seqlens, has_init, silu):
    """Per sequence and token, in float64: y[t] = act(bias + sum_j w[:, j] x[t - (W-1) + j]), the W-1
    inputs before the sequence from its state (or zeros). Returns (y, the pool after the call)."""
    width = weight.shape[1]
    pool = conv_state.double().clone()
    y = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(len(cu_seqlens) - 1):
        row = int(state_indices[i])
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        prev = pool[row].T if has_init[i] else torch.zeros(width - 1, x.shape[1], dtype=torch.float64)
        seq = torch.cat((prev, x[start:end].double()))
        for t in range(end - start):
            acc = (seq[t : t + width].T * weight.double()).sum(1)
            acc = acc + (bias.double() if bias is not None else 0)
            y[start + t] = F.silu(acc) if silu else acc
        pool[row] = seq[-(width - 1) :].T
    return y, pool


@pytest.mark.parametrize(("with_bias", "activation"), [(True, "silu"), (False, None)])
def test_conv_fwd_varlen_matches_naive(gen, with_bias, activation) -> None:
    lens = [1, 2, 7, 40, 3]  # shorter than W-1 keeps part of the old state
    cu = varlen(lens)
    x = torch.randn((int(cu[-1]), CH), generator=gen)
    weight = torch.randn((CH, WIDTH), generator=gen)
    bias = torch.randn(CH, generator=gen) if with_bias else None
    pool = torch.randn((8, CH, WIDTH - 1), generator=gen)
    indices = torch.tensor([5, 1, 7, 0, 3], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True, False])
    ref_y, ref_pool = naive_conv(x, weight, bias, pool, indices, cu, has_init, activation == "silu")
    y = conv.causal_conv1d_fwd(x, weight, bias, conv_state=pool, state_indices=indices, cu_seqlens=cu,
                               has_initial_state=has_init, activation=activation)  # fmt: skip
    assert rel_error(y, ref_y) < 1e-5
    assert rel_error(pool, ref_pool) < 1e-6


def test_conv_matches_transformers(gen) -> None:
    # One sequence without a state (causal_conv1d_fn), then two decode steps (causal_conv1d_update).
    x = torch.randn((9, CH), generator=gen)
    weight = torch.randn((CH, WIDTH), generator=gen)
    bias = torch.randn(CH, generator=gen)
    pool = torch.zeros((2, CH, WIDTH - 1))
    idx = torch.tensor([1], dtype=torch.int32)
    y = conv.causal_conv1d_fwd(x[:7], weight, bias, conv_state=pool, state_indices=idx, cu_seqlens=varlen([7]),
                               has_initial_state=torch.tensor([False]))  # fmt: skip
    assert rel_error(y, causal_conv1d_fn(x[:7].T[None], weight, bias, activation="silu")[0].T) < 1e-5
    hf_state = x[4:7].T[None].clone()
    for t in (7, 8):
        y = conv.causal_conv1d_update(x[t : t + 1], weight, bias, conv_state=pool, state_indices=idx)
        ref = causal_conv1d_update(x[t : t + 1].T[None], hf_state, weight, bias, activation="silu")
        assert rel_error(y, ref[0].T) < 1e-5
        assert rel_error(pool[1], hf_state[0]) < 1e-6


def test_conv_update_with_padded_rows(gen) -> None:
    x = torch.randn((4, CH), generator=gen).to(torch.bfloat16)
    weight = torch.randn((CH, WIDTH), generator=gen)
    pool = torch.randn((5, CH, WIDTH - 1), generator=gen).to(torch.bfloat16)
    indices = torch.tensor([3, 1, 0, -1], dtype=torch.int32)  # rows 2 and 3 pad the batch
    before = pool.clone()
    ref_y, ref_pool = naive_conv(x[:2], weight, None, pool, indices[:2], varlen([1, 1]), [True, True], True)
    y = conv.causal_conv1d_update(x, weight, None, conv_state=pool, state_indices=indices)
    assert y.dtype == torch.bfloat16
    assert rel_error(y[:2], ref_y) < 1e-2
    assert torch.equal(pool[[3, 1]], ref_pool[[3, 1]].to(torch.bfloat16))
    assert torch.equal(pool[[2, 4]], before[[2, 4]])
    zero_y, _ = naive_conv(x[3:], weight, None, pool, [0], varlen([1]), [False], True)
    assert rel_error(y[3:], zero_y) < 1e-2


def test_conv_bad_arguments_are_rejected(gen) -> None:
    x = torch.randn((3, CH), generator=gen)
    weight = torch.randn((CH, WIDTH), generator=gen)
    pool = torch.zeros((2, CH, WIDTH - 1))
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="activation must be one of"):
        conv.causal_conv1d_update(x, weight, None, conv_state=pool, state_indices=idx, activation="gelu")
    with pytest.raises(ValueError, match="conv_state must be"):
        conv.causal_conv1d_update(x, weight, None, conv_state=pool[:, :, :2], state_indices=idx)
    with pytest.raises(ValueError, match="cu_seqlens describes 1 sequences"):
        conv.causal_conv1d_fwd(x, weight, None, conv_state=pool, state_indices=idx, cu_seqlens=varlen([3]),
                               has_initial_state=torch.tensor([False]))  # fmt: skip
