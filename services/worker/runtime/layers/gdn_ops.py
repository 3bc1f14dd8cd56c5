"""The Gated DeltaNet ops in torch: the causal depthwise conv1d and the gated delta rule, over the
state pool (mem/state_pool.py), for varlen extend batches and for decode.

These are the reference (and the CPU path); kernels/gated_delta_rule.py, kernels/causal_conv1d.py and
kernels/gated_rms_norm.py implement the same signatures in Triton (the decode update with the gating
fused in, fused_sigmoid_gating_delta_rule_update, and the gated RMSNorm too). Conventions shared by all four:

- Sequences are packed: token rows of sequence i are cu_seqlens[i] .. cu_seqlens[i+1]-1 (int32 [B+1]);
  decode ops take one row per sequence.
- Sequence i reads and writes its state at row state_indices[i] of the pool tensor, in place. Padded
  rows (CUDA-graph padding) point at a row no request holds (StatePool.PAD_ROW).
- The delta-rule state is float32 [N, Hv, Dk, Dv]; g is the log decay (<= 0) and beta the write
  strength, both float32 [T, Hv]. Hv is a multiple of Hk: each q/k head serves Hv / Hk consecutive v
  heads, as transformers' torch_chunk_gated_delta_rule does.

The chunked rule follows transformers' torch_chunk_gated_delta_rule (the UT transform inside chunks of
64, a scan over chunks), batched over sequences by right-padding them with beta = 0 and g = 0: a padded
token neither writes nor decays the state, so each sequence's final state is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in float32, their heads repeated up to the v heads, l2-normalised, q scaled."""
    groups = num_v_heads // q.shape[-2]
    if groups * q.shape[-2] != num_v_heads:
        raise ValueError(f"v heads ({num_v_heads}) must be a multiple of q/k heads ({q.shape[-2]})")
    q, k = q.float(), k.float()
    if groups > 1:
        q = q.repeat_interleave(groups, dim=-2)
        k = k.repeat_interleave(groups, dim=-2)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * scale, k


def _chunk_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, L, Dk], v [B, H, L, Dv], g, beta [B, H, L] (L a multiple of CHUNK_SIZE, float32),
    state [B, H, Dk, Dv]: (outputs [B, H, L, Dv], final state)."""
    b, h, length, _ = k.shape
    c = CHUNK_SIZE
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, length // c, c, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(b, h, length // c, c).cumsum(dim=-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(length // c):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, length, -1), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Prefill / extend: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] -> o [T, Hv, Dv] (v's dtype).
    Sequence i starts from state[state_indices[i]], which then holds its final state."""
    num_v_heads = v.shape[1]
    q, k = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    batch, longest = len(lengths), max(lengths, default=0)
    if batch == 0 or longest == 0:
        return v.new_zeros(v.shape)
    padded = -(-longest // CHUNK_SIZE) * CHUNK_SIZE
    # Token t of sequence i sits at [i, t - bounds[i]] of the padded [B, L] layout.
    seq_of = torch.repeat_interleave(torch.arange(batch, device=v.device), torch.tensor(lengths, device=v.device))
    starts = torch.tensor(bounds[:-1], device=v.device)
    pos = torch.arange(q.shape[0], device=v.device) - starts[seq_of]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((batch, padded, *x.shape[1:]))
        out[seq_of, pos] = x
        return out.transpose(1, 2).contiguous()  # [B, H, L, ...]

    rows = state_indices.long()
    out, final = _chunk_rule(
        pad(q), pad(k), pad(v.float()), pad(g.float()), pad(beta.float()), state[rows].float()
    )
    state[rows] = final.to(state.dtype)
    return out.transpose(1, 2)[seq_of, pos].to(v.dtype)


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Decode, one token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> o [B, Hv, Dv].
    state[state_indices[i]] is decayed, delta-updated with token i and read by q; kept in place."""
    q, k = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm)
    rows = state_indices.long()
    s = state[rows].float() * g.float().exp()[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state[rows] = s.to(state.dtype)
    return (s * q.unsqueeze(-1)).sum(dim=-2).to(v.dtype)


def sigmoid_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's raw a, b [T, Hv] to (g, beta), float32 [T, Hv]: g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b) (in b's dtype, then float32), as transformers' Qwen3.5 forms them."""
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def fused_sigmoid_gating_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Decode from the raw gates: sigmoid_gating, then fused_recurrent_gated_delta_rule_update (the
    Triton twin computes the gating inside its kernel)."""
    g, beta = sigmoid_gating(a, b, A_log, dt_bias)
    return fused_recurrent_gated_delta_rule_update(
        q, k, v, g, beta, state=state, state_indices=state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight * silu(gate) over the last axis (transformers' Qwen3_5RMSNormGated, rounding
    included: the norm in float32, the scale in the input dtype, the gate in float32)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


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
    """Prefill / extend: x [T, C], weight [C, W] -> y [T, C]. Sequence i's window before its first
    token is conv_state[state_indices[i]] ([C, W-1], oldest first) when has_initial_state[i], else
    zeros; that row then holds the sequence's last W-1 inputs."""
    width = weight.shape[1]
    bounds = cu_seqlens.tolist()
    batch = len(bounds) - 1
    if batch == 0 or x.shape[0] == 0:
        return x.new_zeros(x.shape)
    lengths = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:])], device=x.device)
    rows = state_indices.long()
    # Each sequence as its W-1 previous inputs then its tokens, all sequences stacked: [T + B(W-1), C].
    prev = conv_state[rows].to(weight.dtype) * has_initial_state.to(weight.dtype)[:, None, None]
    seq_of = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths)
    token_row = torch.arange(x.shape[0], device=x.device) + (width - 1) * (seq_of + 1)
    seq_start = torch.tensor(bounds[:-1], device=x.device) + (width - 1) * torch.arange(batch, device=x.device)
    taps = torch.arange(width - 1, device=x.device)
    stacked = x.new_zeros((x.shape[0] + batch * (width - 1), x.shape[1]), dtype=weight.dtype)
    stacked[(seq_start[:, None] + taps).flatten()] = prev.transpose(1, 2).reshape(-1, x.shape[1])
    stacked[token_row] = x.to(weight.dtype)
    # Token row r's window is stacked[r - W + 1 .. r].
    windows = stacked[(token_row - (width - 1))[:, None] + torch.arange(width, device=x.device)]
    y = torch.einsum("tkc,ck->tc", windows, weight)
    if bias is not None:
        y = y + bias
    last = stacked[(seq_start + lengths)[:, None] + taps]  # [B, W-1, C]: the last W-1 inputs
    conv_state[rows] = last.transpose(1, 2).to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode, one token per sequence: x [B, C] -> y [B, C]; conv_state[state_indices[i]] shifts in x[i]."""
    rows = state_indices.long()
    window = torch.cat((conv_state[rows].to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)), dim=-1)
    y = (window * weight).sum(dim=-1)
    if bias is not None:
        y = y + bias
    conv_state[rows] = window[:, :, 1:].to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)
