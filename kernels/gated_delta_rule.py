# Over 400 lines: the chunked prefill and the recurrent decode share their checks and conventions.
"""The gated delta rule of Gated DeltaNet layers (Qwen3.5): chunked prefill and fused recurrent decode.

Per value head, with a state S [Dk, Dv] and for each token: S = S * exp(g); delta = beta * (v - k^T S);
S = S + k delta^T; o = q^T S (transformers' torch_recurrent_gated_delta_rule). q and k are L2-normalised
per head (eps 1e-6) when asked, and q is scaled. Value head h reads q/k head h // (Hv // Hk).

Prefill (chunk_gated_delta_rule) splits each sequence into chunks of CHUNK tokens and uses the WY form
of the delta rule inside a chunk. With gc the cumulative sum of g from the chunk's start and
A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i, T = (I + A)^-1 gives
    w = T (beta exp(gc) k),  u = T (beta v),            (per chunk, no state needed: launch 1)
    v' = u - w S0,  o = (exp(gc) q) S0 + P v',          (sequential over chunks: launch 2)
    S1 = exp(gc_last) S0 + (exp(gc_last - gc) k)^T v',
with P[i, j] = (q_i . k_j) exp(gc_i - gc_j) for j <= i. Launch 1 runs one program per (chunk, head) and
solves for T by forward substitution; launch 2 walks one sequence's chunks per (sequence, head, Dv
tile), keeping its slice of the state in registers, so no per-chunk states are written to memory.
Every exponent is <= 0, so nothing overflows however long the chunk's decay.

Decode (fused_recurrent_gated_delta_rule_update) is the per-token recurrence, one program per
(sequence, head, Dv tile). fused_sigmoid_gating_delta_rule_update (SGLang's name) is the same launch
computing g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) itself from the layer's raw a
and b, which saves a decode step the handful of tiny elementwise kernels that would form them.
Neither path syncs with the host (chunks are mapped to sequences on the device), so both can be
captured in a CUDA graph. A negative state index reads a zero state and writes none; the state pool
is float32 [N, Hv, Dk, Dv].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision

CHUNK = 64
L2NORM_EPS = 1e-6


@triton.jit
def _load_rows(Ptr, tok, t_ok, head, stride_t, stride_h, n_cols, L2NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows tok of head `head` as float32 [len(tok), BLOCK_D] (zero where masked), L2-normalised if asked."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(
        Ptr + tok.to(tl.int64)[:, None] * stride_t + head * stride_h + d[None, :],
        mask=t_ok[:, None] & (d < n_cols)[None, :],
        other=0.0,
    ).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _softplus(x):
    """F.softplus with its defaults (beta 1, threshold 20): x above 20, else log1p(exp(x)), with log1p
    by Kahan's trick (log(1 + u) * u / ((1 + u) - 1)) since log(1 + u) alone loses u below ~1e-7."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    d = w - 1.0
    log1p = tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _chunk_prepare_kernel(
    Q, K, V, G, Beta, Cu, ChunkCu, ChunkSeq, Gc, Wb, Ub, Pb,
    n_q_per_k, dk, dv, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_pt, stride_ph,
    L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    C: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // n_q_per_k
    seq = tl.load(ChunkSeq + chunk)
    first_chunk = tl.load(ChunkCu + seq)
    if chunk < tl.load(ChunkCu + seq + 1):  # programs past the last chunk have nothing to do
        start = tl.load(Cu + seq) + (chunk - first_chunk) * C
        end = tl.load(Cu + seq + 1)
        i = tl.arange(0, C)
        tok = start + i
        t_ok = tok < end
        g = tl.load(G + tok.to(tl.int64) * stride_gt + h, mask=t_ok, other=0.0)
        gc = tl.cumsum(g, 0)
        tl.store(Gc + tok.to(tl.int64) * stride_gt + h, gc, mask=t_ok)
        beta = tl.load(Beta + tok.to(tl.int64) * stride_gt + h, mask=t_ok, other=0.0)
        k = _load_rows(K, tok, t_ok, hk, stride_kt, stride_kh, dk, L2NORM, BLOCK_K)
        q = _load_rows(Q, tok, t_ok, hk, stride_qt, stride_qh, dk, L2NORM, BLOCK_K) * scale
        lower = i[:, None] > i[None, :]
        diff = gc[:, None] - gc[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, diff, 0.0)), 0.0)
        a = beta[:, None] * tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * decay
        # T = (I + A)^-1 by forward substitution over blocks of SUB rows. First the diagonal blocks, all at
        # once: row r of every block, T[i] = e_i - sum_j D[i, j] T[j], needs only earlier rows of its block.
        blk = i // SUB
        same = blk[:, None] == blk[None, :]
        eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
        diag = tl.where(same, a, 0.0)
        t_inv = eye
        for r in range(1, SUB):
            t_inv = tl.where(
                (i % SUB == r)[:, None], eye - tl.dot(diag, t_inv, input_precision=DOT_PRECISION), t_inv
            )
        # Then block row b: T_b = Dinv_b (e_b - sum_{m<b} A_bm T_m), with rows of blocks < b final.
        below = tl.where(same, 0.0, a)
        for b in range(1, C // SUB):
            fix = tl.dot(
                t_inv, tl.dot(below, t_inv, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION
            )
            t_inv = tl.where((blk == b)[:, None], t_inv - fix, t_inv)
        kb = k * (beta * tl.exp(gc))[:, None]
        w = tl.dot(t_inv, kb, input_precision=DOT_PRECISION)
        dk_i = tl.arange(0, BLOCK_K)
        tl.store(
            Wb + tok.to(tl.int64)[:, None] * stride_wt + h * stride_wh + dk_i[None, :],
            w,
            mask=t_ok[:, None] & (dk_i < dk)[None, :],
        )
        dv_i = tl.arange(0, BLOCK_V)
        for v0 in range(0, dv, BLOCK_V):
            cols = v0 + dv_i
            v = tl.load(
                V + tok.to(tl.int64)[:, None] * stride_vt + h * stride_vh + cols[None, :],
                mask=t_ok[:, None] & (cols < dv)[None, :],
                other=0.0,
            ).to(tl.float32)
            u = tl.dot(t_inv, v * beta[:, None], input_precision=DOT_PRECISION)
            tl.store(
                Ub + tok.to(tl.int64)[:, None] * stride_ut + h * stride_uh + cols[None, :],
                u,
                mask=t_ok[:, None] & (cols < dv)[None, :],
            )
        causal = i[:, None] >= i[None, :]
        p_decay = tl.where(causal, tl.exp(tl.where(causal, diff, 0.0)), 0.0)
        p = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * p_decay
        tl.store(
            Pb + tok.to(tl.int64)[:, None] * stride_pt + h * stride_ph + i[None, :], p, mask=t_ok[:, None]
        )


@triton.jit
def _chunk_scan_kernel(
    Q, K, Gc, Wb, Ub, Pb, State, StateIdx, Cu, Out,
    n_q_per_k, dk, dv, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_pt, stride_ph, stride_ot, stride_oh,
    stride_sn, stride_sh, stride_sk,
    L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // n_q_per_k
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_k = tl.arange(0, BLOCK_K)
    i = tl.arange(0, C)
    start = tl.load(Cu + seq)
    end = tl.load(Cu + seq + 1)
    row = tl.load(StateIdx + seq).to(tl.int64)
    s_mask = (rows_k < dk)[:, None] & (cols < dv)[None, :]
    s_ptr = (
        State + tl.maximum(row, 0) * stride_sn + h * stride_sh + rows_k[:, None] * stride_sk + cols[None, :]
    )
    s = tl.load(s_ptr, mask=s_mask & (row >= 0), other=0.0)
    for c0 in range(start, end, C):
        tok = c0 + i
        t_ok = tok < end
        tok64 = tok.to(tl.int64)
        gc = tl.load(Gc + tok64 * stride_gt + h, mask=t_ok, other=0.0)
        g_last = tl.load(Gc + tl.minimum(c0 + C, end).to(tl.int64) * stride_gt - stride_gt + h)
        w = tl.load(
            Wb + tok64[:, None] * stride_wt + h * stride_wh + rows_k[None, :],
            mask=t_ok[:, None] & (rows_k < dk)[None, :],
            other=0.0,
        )
        u = tl.load(
            Ub + tok64[:, None] * stride_ut + h * stride_uh + cols[None, :],
            mask=t_ok[:, None] & (cols < dv)[None, :],
            other=0.0,
        )
        p = tl.load(
            Pb + tok64[:, None] * stride_pt + h * stride_ph + i[None, :], mask=t_ok[:, None], other=0.0
        )
        q = _load_rows(Q, tok, t_ok, hk, stride_qt, stride_qh, dk, L2NORM, BLOCK_K)
        k = _load_rows(K, tok, t_ok, hk, stride_kt, stride_kh, dk, L2NORM, BLOCK_K)
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        o = tl.dot(q * (scale * tl.exp(gc))[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(p, v_new, input_precision=DOT_PRECISION)
        tl.store(
            Out + tok64[:, None] * stride_ot + h * stride_oh + cols[None, :],
            o.to(Out.dtype.element_ty),
            mask=t_ok[:, None] & (cols < dv)[None, :],
        )
        k_end = k * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k_end), v_new, input_precision=DOT_PRECISION)
    tl.store(s_ptr, s, mask=s_mask & (row >= 0))


@triton.jit
def _recurrent_kernel(
    Q, K, V, G, Beta, ALog, DtBias, State, StateIdx, Cu, Out,
    n_q_per_k, dk, dv, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
    VARLEN: tl.constexpr, GATING: tl.constexpr, L2NORM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """With GATING, G and Beta hold the raw a and b (beta rounded to b's dtype, as b.sigmoid() is)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // n_q_per_k
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_k = tl.arange(0, BLOCK_K)
    k_ok = rows_k < dk
    v_ok = cols < dv
    if VARLEN:
        start = tl.load(Cu + seq).to(tl.int64)
        end = tl.load(Cu + seq + 1).to(tl.int64)
    else:
        start = seq.to(tl.int64)
        end = start + 1
    row = tl.load(StateIdx + seq).to(tl.int64)
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_ptr = (
        State + tl.maximum(row, 0) * stride_sn + h * stride_sh + rows_k[:, None] * stride_sk + cols[None, :]
    )
    s = tl.load(s_ptr, mask=s_mask & (row >= 0), other=0.0)
    for t64 in range(start, end):
        q = tl.load(Q + t64 * stride_qt + hk * stride_qh + rows_k, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(K + t64 * stride_kt + hk * stride_kh + rows_k, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(V + t64 * stride_vt + h * stride_vh + cols, mask=v_ok, other=0.0).to(tl.float32)
        if GATING:
            x = tl.load(G + t64 * stride_gt + h).to(tl.float32) + tl.load(DtBias + h).to(tl.float32)
            g = -tl.exp(tl.load(ALog + h).to(tl.float32)) * _softplus(x)
            beta = tl.sigmoid(tl.load(Beta + t64 * stride_bt + h).to(tl.float32))
            beta = beta.to(Beta.dtype.element_ty).to(tl.float32)
        else:
            g = tl.load(G + t64 * stride_gt + h)
            beta = tl.load(Beta + t64 * stride_bt + h)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * (q * scale)[:, None], 0)
        tl.store(Out + t64 * stride_ot + h * stride_oh + cols, o.to(Out.dtype.element_ty), mask=v_ok)
    tl.store(s_ptr, s, mask=s_mask & (row >= 0))


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    batch: int,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[int, int, int, int]:
    """Shapes and layouts both paths need; returns (Hk, Hv, Dk, Dv). With `gating` (A_log, dt_bias),
    g and beta are the raw a and b."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv] over the same tokens, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"the value heads ({hv}) must be a multiple of the key heads ({hk})")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v need a contiguous last axis")
    if gating is None:
        for name, x in (("g", g), ("beta", beta)):
            if x.shape != (tokens, hv) or x.dtype != torch.float32 or not x.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 [{tokens}, {hv}], got "
                                 f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    else:
        for name, x in (("a", g), ("b", beta)):
            if x.shape != (tokens, hv) or not x.is_floating_point() or x.stride(-1) != 1:
                raise ValueError(f"{name} must be a floating-point [{tokens}, {hv}] with a contiguous last "
                                 f"axis, got {x.dtype} {tuple(x.shape)}")  # fmt: skip
        for name, x in zip(("A_log", "dt_bias"), gating):
            if x.shape != (hv,) or not x.is_floating_point() or not x.is_contiguous():
                raise ValueError(f"{name} must be a contiguous floating-point [{hv}], got "
                                 f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be a float32 pool [N, {hv}, {dk}, {dv}], got {state.dtype} "
                         f"{tuple(state.shape)}")  # fmt: skip
    if state.stride(3) != 1:
        raise ValueError("state needs a contiguous last axis")
    if state_indices.shape != (batch,):
        raise ValueError(
            f"state_indices must have one entry per sequence ({batch}), got {tuple(state_indices.shape)}"
        )
    if dk < 16 or dv < 16:
        raise ValueError(f"head dims below 16 are not supported (tl.dot), got Dk={dk}, Dv={dv}")
    return hk, hv, dk, dv


def _v_block(dv: int, programs_without: int) -> int:
    """Dv tile of the sequential launches: narrower tiles give more programs when there are few."""
    block = 64 if programs_without >= 264 else 32
    return min(block, triton.next_power_of_2(dv))


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
    """Varlen prefill/extend: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay) and beta [T, Hv] float32;
    sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1], starts from state[state_indices[i]] and leaves its
    final state there. Returns o [T, Hv, Dv] in v's dtype."""
    batch = cu_seqlens.shape[0] - 1
    hk, hv, dk, dv = _check(q, k, v, g, beta, state, state_indices, batch)
    tokens = q.shape[0]
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if tokens == 0 or batch == 0:
        return o
    dev = q.device
    cu = cu_seqlens.to(torch.int32)
    # Chunk -> sequence on the device. There are at most T // CHUNK + B chunks; the extra programs exit.
    chunk_cu = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    chunk_cu[1:] = torch.cumsum(torch.div(cu[1:] - cu[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor"), 0)
    max_chunks = tokens // CHUNK + batch
    chunk_seq = torch.searchsorted(
        chunk_cu[1:], torch.arange(max_chunks, dtype=torch.int32, device=dev), right=True
    )
    chunk_seq = chunk_seq.to(torch.int32).clamp_(max=batch - 1)
    gc = torch.empty((tokens, hv), dtype=torch.float32, device=dev)
    w = torch.empty((tokens, hv, dk), dtype=torch.float32, device=dev)
    u = torch.empty((tokens, hv, dv), dtype=torch.float32, device=dev)
    p = torch.empty((tokens, hv, CHUNK), dtype=torch.float32, device=dev)
    block_k = triton.next_power_of_2(dk)
    precision = dot_precision(v.dtype)
    _chunk_prepare_kernel[(max_chunks, hv)](
        q, k, v, g, beta, cu, chunk_cu, chunk_seq, gc, w, u, p,
        hv // hk, dk, dv, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), p.stride(0), p.stride(1),
        L2NORM=use_qk_l2norm, DOT_PRECISION=precision,
        C=CHUNK, SUB=16, BLOCK_K=block_k, BLOCK_V=min(64, triton.next_power_of_2(dv)), num_warps=4,
    )  # fmt: skip
    block_v = _v_block(dv, batch * hv)
    # num_stages=1: pipelining the chunk loop's float32 loads needs 287 KB of shared memory at Dk=128,
    # over the H200's 227 KB (seen on the GPU); the loop is latency-bound by its dots anyway.
    _chunk_scan_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, gc, w, u, p, state, state_indices, cu, o,
        hv // hk, dk, dv, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), p.stride(0), p.stride(1), o.stride(0), o.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=use_qk_l2norm, DOT_PRECISION=precision,
        C=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4, num_stages=1,
    )  # fmt: skip
    return o


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    batch = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    hk, hv, dk, dv = _check(q, k, v, g, beta, state, state_indices, batch, gating)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or q.shape[0] == 0:
        return o
    block_v = _v_block(dv, batch * hv)
    cu = state_indices if cu_seqlens is None else cu_seqlens.to(torch.int32)  # Cu is unread in decode
    a_log, dt_bias = (g, g) if gating is None else gating  # unread without GATING
    _recurrent_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, a_log, dt_bias, state, state_indices, cu, o,
        hv // hk, dk, dv, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), o.stride(0), o.stride(1), state.stride(0), state.stride(1), state.stride(2),
        VARLEN=cu_seqlens is not None, GATING=gating is not None, L2NORM=use_qk_l2norm,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4,
    )  # fmt: skip
    return o


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
    """Decode: one token per sequence (q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv]); sequence b's
    state is state[state_indices[b]], updated in place. Returns o [B, Hv, Dv] in v's dtype."""
    return _recurrent(q, k, v, g, beta, state, state_indices, None, scale, use_qk_l2norm)


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
    """fused_recurrent_gated_delta_rule_update with the gating computed in the kernel from the layer's raw
    a, b [B, Hv] (any row stride, e.g. views of the in_proj output) and A_log, dt_bias [Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = sigmoid(b) rounded to b's dtype."""
    return _recurrent(q, k, v, a, b, state, state_indices, None, scale, use_qk_l2norm, (A_log, dt_bias))


def recurrent_gated_delta_rule(
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
    """chunk_gated_delta_rule's contract computed token by token (one program walks a whole sequence):
    the plain recurrence, kept as a cross-check and a baseline for the chunked kernel."""
    return _recurrent(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, use_qk_l2norm)
