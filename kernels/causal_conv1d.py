"""Depthwise causal conv1d of Gated DeltaNet layers (Qwen3.5), over packed variable-length sequences.

Channel c of token t: y[t, c] = act(bias[c] + sum_j weight[c, j] * x[t - (W-1) + j, c]), j = 0..W-1, the
taps of torch's conv1d (cross-correlation) as transformers' causal_conv1d_fn applies them. Inputs before
a sequence's first token come from its conv state, [N, C, W-1] rows of a pool, oldest first (column W-2
is the newest input), or are zero for a sequence without one. After a call each sequence's state row
holds its last W-1 inputs, older state included when the sequence is shorter than W-1.

Prefill runs two launches, so no program overwrites a state another is still reading: one computes the
outputs (programs over token x channel tiles, each token finding its sequence by a search of
cu_seqlens on the device), the next writes the new states. Decode (one token per sequence) reads the
window, writes the output and rolls the state in one program per (sequence, channel tile). Neither
syncs with the host, so both can be captured in a CUDA graph. A negative state index (a padded decode
row) reads a zero state and writes none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = (None, "silu")


@triton.jit
def _conv_fwd_kernel(
    X, Wt, Bias, State, StateIdx, HasInit, Cu, TokSeq, Y,
    n_tokens, n_channels,
    stride_xt, stride_yt, stride_sn, stride_sc,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = tok < n_tokens
    c_ok = ch < n_channels
    seq = tl.load(TokSeq + tok, mask=t_ok, other=0)
    start = tl.load(Cu + seq, mask=t_ok, other=0)
    row = tl.load(StateIdx + seq, mask=t_ok, other=-1).to(tl.int64)
    from_state = t_ok & (tl.load(HasInit + seq, mask=t_ok, other=0) != 0) & (row >= 0)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + ch, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        pos = tok - (W - 1) + j  # the input this tap reads; before `start` it lies in the state
        w = tl.load(Wt + ch * W + j, mask=c_ok, other=0.0).to(tl.float32)
        in_seq = pos >= start
        xv = tl.load(
            X + pos.to(tl.int64)[:, None] * stride_xt + ch[None, :],
            mask=(t_ok & in_seq)[:, None] & c_ok[None, :],
            other=0.0,
        )
        col = (W - 1) + pos - start
        sv = tl.load(
            State + row[:, None] * stride_sn + ch[None, :] * stride_sc + col[:, None],
            mask=(from_state & ~in_seq)[:, None] & c_ok[None, :],
            other=0.0,
        )
        acc += w[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(
        Y + tok.to(tl.int64)[:, None] * stride_yt + ch[None, :],
        acc.to(Y.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _conv_state_kernel(
    X, State, StateIdx, HasInit, Cu, n_channels,
    stride_xt, stride_sn, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.arange(0, BLOCK_W)
    row = tl.load(StateIdx + seq).to(tl.int64)
    if row >= 0:
        start = tl.load(Cu + seq)
        length = tl.load(Cu + seq + 1) - start
        has_init = tl.load(HasInit + seq) != 0
        c_ok = ch < n_channels
        keep = c_ok[:, None] & (m < W - 1)[None, :]
        pos = length - (W - 1) + m  # sequence position of new state column m
        xv = tl.load(
            X + (start + pos).to(tl.int64)[None, :] * stride_xt + ch[:, None],
            mask=keep & (pos >= 0)[None, :],
            other=0.0,
        )
        base = State + row * stride_sn + ch[:, None] * stride_sc
        sv = tl.load(base + ((W - 1) + pos)[None, :], mask=keep & (pos < 0)[None, :] & has_init, other=0.0)
        new = xv.to(tl.float32) + sv.to(tl.float32)
        tl.debug_barrier()  # every old column is read before any is overwritten
        tl.store(base + m[None, :], new.to(State.dtype.element_ty), mask=keep)


@triton.jit
def _conv_update_kernel(
    X, Wt, Bias, State, StateIdx, Y, n_channels,
    stride_xb, stride_yb, stride_sn, stride_sc,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    c_ok = ch < n_channels
    row = tl.load(StateIdx + b).to(tl.int64)
    has_row = row >= 0
    base = State + tl.maximum(row, 0) * stride_sn + ch[:, None] * stride_sc
    # window[:, j]: state columns 0..W-2 (oldest first), then this token's input at j = W-1
    sv = tl.load(base + j[None, :], mask=c_ok[:, None] & (j < W - 1)[None, :] & has_row, other=0.0)
    xv = tl.load(X + b.to(tl.int64) * stride_xb + ch, mask=c_ok, other=0.0)
    window = tl.where((j == W - 1)[None, :], xv.to(tl.float32)[:, None], sv.to(tl.float32))
    w = tl.load(Wt + ch[:, None] * W + j[None, :], mask=c_ok[:, None] & (j < W)[None, :], other=0.0)
    acc = tl.sum(window * w.to(tl.float32), 1)
    if HAS_BIAS:
        acc += tl.load(Bias + ch, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Y + b.to(tl.int64) * stride_yb + ch, acc.to(Y.dtype.element_ty), mask=c_ok)
    tl.debug_barrier()  # every old column is read before any is overwritten
    shifted = c_ok[:, None] & (j >= 1)[None, :] & (j < W)[None, :] & has_row
    tl.store(base + (j - 1)[None, :], window.to(State.dtype.element_ty), mask=shifted)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None,
) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [tokens, channels] with contiguous channels, got shape {tuple(x.shape)}")
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{channels}, W], got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"the conv width must be at least 2, got {width}")
    if bias is not None and (bias.shape != (channels,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{channels}], got shape {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (channels, width - 1) or conv_state.stride(2) != 1:
        raise ValueError(
            f"conv_state must be [N, {channels}, {width - 1}] with a contiguous last axis, "
            f"got shape {tuple(conv_state.shape)}"
        )
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices must be 1-D, got shape {tuple(state_indices.shape)}")
    return width


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over each sequence of x [T, C] (sequence i is x[cu_seqlens[i]:cu_seqlens[i+1]])
    with weight [C, W]; conv_state[state_indices[i]] supplies sequence i's previous W-1 inputs when
    has_initial_state[i] (zeros otherwise) and holds its last W-1 inputs afterwards. Returns y [T, C]."""
    width = _check(x, weight, bias, conv_state, state_indices, activation)
    batch = cu_seqlens.shape[0] - 1
    if state_indices.shape[0] != batch or has_initial_state.shape != (batch,):
        raise ValueError(
            f"cu_seqlens describes {batch} sequences, but state_indices has shape {tuple(state_indices.shape)} "
            f"and has_initial_state {tuple(has_initial_state.shape)}"
        )
    tokens, channels = x.shape
    y = torch.empty_like(x)
    if tokens == 0 or batch == 0:
        return y
    cu = cu_seqlens.to(torch.int32)
    has_init = has_initial_state.to(torch.int32)
    # Token -> sequence on the device: no host sync, so the call stays capturable.
    tok_seq = torch.searchsorted(cu[1:], torch.arange(tokens, device=x.device, dtype=torch.int32), right=True)
    tok_seq = tok_seq.to(torch.int32).clamp_(max=batch - 1)
    block_t, block_c = 32, min(128, triton.next_power_of_2(channels))
    _conv_fwd_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, state_indices, has_init, cu, tok_seq, y,
        tokens, channels, x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_state_kernel[(batch, triton.cdiv(channels, block_c))](
        x, conv_state, state_indices, has_init, cu, channels,
        x.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=width, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(width - 1),
    )  # fmt: skip
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per sequence: x [B, C]; conv_state[state_indices[b]] (the previous W-1 inputs) is
    rolled in place to end with x[b]. Returns y [B, C]."""
    width = _check(x, weight, bias, conv_state, state_indices, activation)
    batch, channels = x.shape
    if state_indices.shape[0] != batch:
        raise ValueError(f"state_indices has {state_indices.shape[0]} rows for a batch of {batch}")
    y = torch.empty_like(x)
    if batch == 0:
        return y
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, state_indices, y, channels,
        x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(width),
    )  # fmt: skip
    return y
