"""Decode attention over the token-paged KV pool: split-K ("flash-decoding") in two launches.

One query token per request attends to positions 0 .. seq_len-1, whose KV slots are read through
req_to_token. Decode is bound by reading K and V, so the kernel is shaped around reading each KV tile
exactly once and keeping the whole GPU busy:

- Stage 1, grid (request, kv_head, split): a program takes every query head that shares one KV head
  (the GQA group, padded to 16 rows so `tl.dot` can use the tensor cores) and one contiguous chunk of
  the sequence. It streams the chunk's K/V tiles once, keeps an online softmax, and writes a
  normalized partial output plus its log-sum-exp (base 2).
- Stage 2, grid (request, head): merges the splits, weighting each by exp2(lse - max lse).

The number of splits per request lives in a device tensor (so a CUDA graph can replay with new
lengths); the grid's split dimension is a fixed power-of-two bound chosen on the host. A batch of one
long request gets many splits; a large batch gets few, because its requests already fill the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A split shorter than this spends more on its partial write and the merge than on reading KV.
MIN_TOKENS_PER_SPLIT = 256
# Upper bound on splits per request (also the merge kernel's vector width).
MAX_KV_SPLITS = 64
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeTiles:
    """Stage 1's launch shape: keys per tile, warps, and pipelining depth of the KV loads."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 products ("ieee") so float32 runs match float32 references;
    Triton's default for them is tf32, about 3e-4 relative error. Half types use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"


def max_kv_splits_for(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Grid bound on splits for a batch: enough (request, kv_head, split) programs for about four per
    SM, as a power of two (the merge kernel's width). It depends on the batch shape only, never on the
    lengths, so a CUDA graph captured for a batch size stays valid; kv_splits_per_request decides how
    many of those splits each request really uses, and the rest exit at once."""
    if batch_size < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(
            f"batch_size, num_kv_heads, num_sms must be >= 1, got {batch_size}, {num_kv_heads}, {num_sms}"
        )
    wanted = triton.cdiv(4 * num_sms, batch_size * num_kv_heads)
    return triton.next_power_of_2(max(1, min(wanted, MAX_KV_SPLITS)))


def kv_splits_per_request(
    seq_lens: torch.Tensor,
    max_kv_splits: int,
    out: torch.Tensor | None = None,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> torch.Tensor:
    """Splits for each request (int32, on seq_lens' device, no host sync): one per
    min_tokens_per_split tokens, between 1 and max_kv_splits. Written into `out` when given."""
    splits = torch.clamp((seq_lens + min_tokens_per_split - 1) // min_tokens_per_split, 1, max_kv_splits)
    if out is None:
        return splits.to(torch.int32)
    out.copy_(splits)
    return out


@triton.jit
def _decode_split_kernel(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Num_splits,
    Part_out,
    Part_lse,
    sm_scale_log2,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.load(Num_splits + b)
    if split < num_splits:
        seq_len = tl.load(Seq_lens + b).to(tl.int32)
        req_row = tl.load(Req_pool_indices + b).to(tl.int64)
        # Whole tiles per split so only the sequence's last tile is partial.
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)

        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        h_mask = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        token_row = Req_to_token + req_row * stride_r2t
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < end
            slots = tl.load(token_row + pos, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(
                K_buf + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            ).to(q.dtype)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # An empty split (the tail of a short sequence) writes lse = -inf, which the merge weighs as 0.
        has_tokens = l_i > 0
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        part = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
        tl.store(
            Part_out + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + offs_d[None, :],
            part,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(Part_lse + b * stride_plb + heads * stride_plh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    Part_out,
    Part_lse,
    Num_splits,
    Out,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    num_splits = tl.load(Num_splits + b)
    offs_s = tl.arange(0, MAX_SPLITS)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Part_lse + b * stride_plb + head * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    # A request with no tokens at all (a padded CUDA-graph row) gets zeros, not NaN.
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    parts = tl.load(
        Part_out + b * stride_pob + head * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def alloc_decode_partials(
    batch_size: int, num_heads: int, max_kv_splits: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for stage 1: partial outputs [bs, heads, splits, head_dim] and their lse [bs, heads, splits]."""
    part_out = torch.empty(
        (batch_size, num_heads, max_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((batch_size, num_heads, max_kv_splits), dtype=torch.float32, device=device)
    return part_out, part_lse


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """Attention of q [bs, heads * head_dim] over each request's first seq_lens[i] positions.

    k_buffer/v_buffer: one layer's pool, [slots, kv_heads, head_dim]; out: [bs, heads * head_dim] (written);
    num_kv_splits: [bs] int32 from kv_splits_per_request; part_out/part_lse: alloc_decode_partials scratch
    with at least bs rows and max_kv_splits splits. Launches two kernels and never syncs with the host.
    """
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    batch_size = q.shape[0]
    num_heads = q.shape[-1] // head_dim if q.dim() == 2 else q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("k_buffer/v_buffer: the head_dim axis must be contiguous")
    if part_out.shape[0] < batch_size or part_out.shape[2] < max_kv_splits:
        raise ValueError(
            f"part_out {tuple(part_out.shape)} too small for bs {batch_size}, {max_kv_splits} splits"
        )
    if max_kv_splits & (max_kv_splits - 1):
        raise ValueError(f"max_kv_splits must be a power of two, got {max_kv_splits}")
    tiles = tiles or DecodeTiles()
    q3 = q.view(batch_size, num_heads, head_dim)
    o3 = out.view(batch_size, num_heads, head_dim)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(batch_size, num_kv_heads, max_kv_splits)](
        q3,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_kv_splits,
        part_out,
        part_lse,
        sm_scale * _LOG2E,
        q3.stride(0),
        q3.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    _decode_merge_kernel[(batch_size, num_heads)](
        part_out,
        part_lse,
        num_kv_splits,
        o3,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        o3.stride(0),
        o3.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MAX_SPLITS=max_kv_splits,
        num_warps=4,
    )
    return out
