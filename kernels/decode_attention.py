# Over 400 lines: the kernel, its in-launch merge and the host-side split sizing share one contract.
"""Decode attention over the token-paged KV pool: split-K ("flash-decoding") in one launch.

One query token per request attends to positions 0 .. seq_len-1, whose KV slots are read through
req_to_token. Decode is bound by reading K and V, so the kernel is shaped around reading each KV tile
exactly once and keeping the whole GPU busy. Grid (request, kv_head, split): a program takes every query
head that shares one KV head (the GQA group, padded to 16 rows so `tl.dot` can use the tensor cores) and
one contiguous chunk of the sequence, streams the chunk's K/V tiles once and keeps an online softmax.

- A request with one split (a short context) writes its normalized output straight to `out`.
- With several splits, each program writes a normalized partial output plus its log-sum-exp (base 2) to
  scratch and counts itself in on a per-(request, kv_head) counter; the program that arrives last merges
  the splits, weighting each by exp2(lse - max lse), and sets the counter back to zero.

A float8 pool (services/worker/mem/memory_pool.py) is read as stored and converted to q's dtype; its K
scale is folded into the softmax scale and its V scale multiplies each split's output.

So every split count costs one launch: batch-1 decode is bound by launches, and a separate merge launch
would add one per layer. The number of splits per request is computed on the device (so a CUDA graph can
replay with new lengths): by each program from its request's length, or read from a tensor a caller
filled (kv_splits_per_request); the grid's split dimension is a fixed power-of-two bound chosen on the host. A
batch of one long request gets many splits; a large batch gets few, because its requests already fill
the GPU.

Deterministic inference fixes the split size instead (`split_tokens`): split s always covers the same
positions, so a request's reduction over its keys (tiles, splits, and the merge in split order) depends on
its own length only, never on the batch; the deterministic backend's extend path runs this kernel's split
loop (`_attend_split`) for each new token, several tokens of a request in the rows this kernel pads
(kernels/token_block_attention.py), so a token's attention is the same bits in a prefill, a chunk or a
decode step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_rope import DecodeRope, rope_operands
from kernels.kv_store import fp8_max
from kernels.pdl import launch_options, pdl_enter, pdl_mode
from kernels.qk_norm_rope import rope_heads, store_new_kv

# A split's shortest length: one 64-key tile. Batch-1 decode of an 8B model at a 256-token context ran
# 3 % faster on the H200 with 64 than with 256 (a 0.6B model 10 %; 32 was slower again), because one KV
# head's keys are read by several programs at once instead of one program looping over four tiles.
# Large batches are bounded by max_kv_splits_for instead, so this only shapes small ones.
MIN_TOKENS_PER_SPLIT = 64
# Upper bound on splits per request (also the merge's vector width over splits).
MAX_KV_SPLITS = 64
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeTiles:
    """Stage 1's launch shape: keys per tile, warps, and pipelining depth of the KV loads."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Grid order: True launches (kv_head, request, split), so the programs resident at once read the
    # neighbouring heads of the same tokens' K/V rows; False, (request, kv_head, split).
    head_major: bool = True
    # Load each K tile as [keys, head_dim] (each key's row contiguous in the pool) and transpose it in
    # registers; False addresses it as [head_dim, keys].
    k_rows: bool = True


# Measured on the H200 (bench/results/gpu_decode_sweep_2026-11-29_a.json), P3's batch of 256 with
# 100..2048-token contexts read the pool at 0.71 of copy bandwidth with (request, kv_head) order and K
# addressed by columns, 0.85 with both switches above and 0.95 adding 128-key tiles; batch 64 at 1-4k
# tokens 0.75 -> 0.86. Batch 1 is unchanged by the switches and slower with 128-key tiles.
WIDE_BATCH_TILES = DecodeTiles(block_n=128)
NARROW_BATCH_TILES = DecodeTiles()
WIDE_BATCH = 32
# One request: 8 warps a program. A batch-1 launch is a few dependent round trips long (the q/k norm and
# rotary over its GQA group padded to 16 rows, one 64-key tile per program, the merge), and twice the
# threads shorten each step of that chain: H100, with its prologue, graphs of 28 launches
# (bench/gpu_decode_warps.py, gpu_decode_warps_2026-12-06_a): 0.6B and 8B heads 7.75 -> 6.69 us at 256
# tokens, 11.6 -> 8.8 at 1,024; the 0.6B Engine's batch-1 decode 1.045x. From two requests on it loses
# (1,024 tokens: 1.08-1.10x the time at 2, 1.18 at 4, 1.28-1.55 from 8), as more programs then share the SMs.
SINGLE_REQUEST_TILES = DecodeTiles(num_warps=8)
# RS_DECODE_W8=0 runs one request's launch at 4 warps too (A/B runs: bench/gpu_pdl.py --env RS_DECODE_W8).
SINGLE_REQUEST_WARPS_ENV = "RS_DECODE_W8"


def tiles_for(batch_size: int) -> DecodeTiles:
    """The launch shape decode_attention uses when given none: 8 warps for one request, 128-key tiles from
    WIDE_BATCH requests."""
    if batch_size == 1 and os.environ.get(SINGLE_REQUEST_WARPS_ENV, "1") != "0":
        return SINGLE_REQUEST_TILES
    return WIDE_BATCH_TILES if batch_size >= WIDE_BATCH else NARROW_BATCH_TILES


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 products ("ieee") so float32 runs match float32 references;
    Triton's default for them is tf32, about 3e-4 relative error. Half types use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"


def max_kv_splits_for(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Grid bound on splits for a batch: enough (request, kv_head, split) programs for about four per
    SM, as a power of two (the merge's width). It depends on the batch shape only, never on the
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


def fixed_size_kv_splits(
    seq_lens: torch.Tensor, split_tokens: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Splits per request for decode_attention(split_tokens=...): cdiv(seq_len, split_tokens), at least 1
    (int32, on seq_lens' device, no host sync). Written into `out` when given."""
    splits = torch.clamp((seq_lens + split_tokens - 1) // split_tokens, min=1)
    if out is None:
        return splits.to(torch.int32)
    out.copy_(splits)
    return out


@triton.jit
def _merge_splits(
    Part_out,
    Part_lse,
    Out,
    lse_rows,
    part_rows,
    out_rows,
    h_mask,
    offs_d,
    d_mask,
    num_splits,
    stride_pos,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """Write to Out's rows (element offsets `out_rows`) the splits' partial outputs (rows at `part_rows`,
    their lse at `lse_rows`, split s at + s * stride_pos and + s) weighted by exp2(lse - max lse). Splits
    are summed in index order, whichever program runs this, so the result is the same on every run."""
    # .cg reads from L2, where the other programs' writes landed, never from this SM's L1.
    offs_s = tl.arange(0, MAX_SPLITS)
    lse_ptrs = Part_lse + lse_rows
    lse = tl.load(
        lse_ptrs[:, None] + offs_s[None, :],
        mask=h_mask[:, None] & (offs_s[None, :] < num_splits),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    m = tl.max(lse, 1)
    m = tl.where(m > float("-inf"), m, 0.0)
    part_ptrs = Part_out + part_rows[:, None] + offs_d[None, :]
    hd_mask = h_mask[:, None] & d_mask[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(num_splits):
        # An empty split (the tail of a short sequence) has lse = -inf and weighs 0.
        w = tl.exp2(tl.load(lse_ptrs + s, mask=h_mask, other=float("-inf"), cache_modifier=".cg") - m)
        part = tl.load(part_ptrs + s * stride_pos, mask=hd_mask, other=0.0, cache_modifier=".cg")
        acc += part * w[:, None]
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(Out + out_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=hd_mask)


@triton.jit
def _attend_split(
    q,
    K_buf,
    V_buf,
    token_row,
    start,
    end,
    row_end,
    kv_head,
    offs_d,
    d_mask,
    sm_scale_log2,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_ROWS: tl.constexpr,
    ROW_ENDS: tl.constexpr,
):
    """One split's online softmax over positions [start, end) of one request (slots from `token_row`):
    (m, l, acc) for q's BLOCK_H rows. ROW_ENDS: row i stops at row_end[i] <= end instead (rows of several
    query tokens of that request); its arithmetic over its own keys is then the one-end case's, tile for
    tile: a tile past a row's end leaves its m, l and acc as they were (alpha 1, p 0)."""
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        slots = tl.load(token_row + pos, mask=n_mask, other=0).to(tl.int64)
        if K_ROWS:
            k = tl.trans(
                tl.load(
                    K_buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0,
                ).to(q.dtype)
            )
        else:
            k = tl.load(
                K_buf + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            ).to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
        if ROW_ENDS:
            s = tl.where(pos[None, :] < row_end[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no key in this tile keeps its state exactly (alpha 1, p 0); its m_new may be -inf
            # (no key yet), which is never subtracted. Rows with keys subtract m_new as above.
            active = row_end > n0
            m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.where(active, tl.exp2(m_i - m_sub), 1.0)
            p = tl.exp2(s - m_sub[:, None])
        else:
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
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Num_splits,
    Out,
    Part_out,
    Part_lse,
    Split_counters,
    Positions,
    K_new,
    V_new,
    Cos,
    Sin,
    Q_w,
    K_w,
    Loc,
    eps,
    inv_k_scale,
    inv_v_scale,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cos,
    stride_sin,
    sm_scale_log2,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    stride_ob,
    stride_oh,
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
    MAX_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    K_ROWS: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    SPLITS_FROM_LENS: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    if HEAD_MAJOR:
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    first_split = tl.program_id(2)
    # Clamped to MAX_SPLITS, so every split that is counted below is also run.
    if SPLITS_FROM_LENS > 0:
        # The split count from the length itself (kv_splits_per_request's or fixed_size_kv_splits'
        # arithmetic): no launches before the graph's layers to fill a tensor of them.
        seq_len = tl.load(Seq_lens + b).to(tl.int32)
        num_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, SPLITS_FROM_LENS), 1), MAX_SPLITS)
    else:
        num_splits = tl.minimum(tl.maximum(tl.load(Num_splits + b), 1), MAX_SPLITS)
    if first_split < num_splits:
        if SPLITS_FROM_LENS == 0:
            seq_len = tl.load(Seq_lens + b).to(tl.int32)
        req_row = tl.load(Req_pool_indices + b).to(tl.int64)
        if SPLIT_TOKENS > 0:
            # Fixed-size splits (deterministic inference): the split boundaries depend on nothing else.
            split_len = SPLIT_TOKENS
        else:
            # Whole tiles per split so only the sequence's last tile is partial.
            split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N

        offs_h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_h
        h_mask = offs_h < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        hd_mask = h_mask[:, None] & d_mask[None, :]
        if ROPE:
            # The q/k norm, rotary and KV store (kernels/qk_norm_rope.py's arithmetic) as this launch's
            # prologue: every program rotates its own q heads, and the program whose split holds the new
            # position stores that token's K/V head before its loop reads the pool.
            new_pos = tl.load(Positions + b).to(tl.int64)
            offs_half = tl.arange(0, HEAD_DIM // 2)
            cos = tl.load(Cos + new_pos * stride_cos + offs_half).to(tl.float32)[None, :]
            sin = tl.load(Sin + new_pos * stride_sin + offs_half).to(tl.float32)[None, :]
            q = rope_heads(
                Q + b * stride_qb, heads, h_mask, stride_qh, Q_w, eps, cos, sin, HAS_NORM, HEAD_DIM, HEAD_DIM // 2
            )
        else:
            q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)

        # A grid narrower than the splits (grid_splits) walks them: split s's arithmetic is the same
        # whichever program runs it, and the merge below adds the splits in index order.
        for split in range(first_split, num_splits, tl.num_programs(2)):
            start = split * split_len
            end = tl.minimum(start + split_len, seq_len)
            if ROPE:
                if (end >= seq_len) & ((start < seq_len) | (split == 0)):
                    store_new_kv(
                        K_new + b * stride_knt, V_new + b * stride_vnt, kv_head, stride_knh, stride_vnh, K_w, eps,
                        cos, sin, K_buf, V_buf, tl.load(Loc + b).to(tl.int64), stride_kt, stride_kh, stride_vt,
                        stride_vh, inv_k_scale, inv_v_scale, HAS_NORM, FP8_MAX, HEAD_DIM, HEAD_DIM // 2,
                    )
                    # The loop below reads that slot back through other threads of this program.
                    tl.debug_barrier()

            m_i, l_i, acc = _attend_split(
                q, K_buf, V_buf, Req_to_token + req_row * stride_r2t, start, end, end, kv_head, offs_d, d_mask,
                sm_scale_log2, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PRECISION,
                K_ROWS, False,
            )

            # No tokens (an empty split, or a padded CUDA-graph row of length 0) gives zeros and lse = -inf.
            has_tokens = l_i > 0
            part = acc / tl.where(has_tokens, l_i, 1.0)[:, None] * v_scale
            if num_splits == 1:
                tl.store(
                    Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                    part.to(Out.dtype.element_ty),
                    mask=hd_mask,
                )
            else:
                lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
                part_rows = Part_out + b * stride_pob + heads[:, None] * stride_poh + offs_d[None, :]
                tl.store(part_rows + split * stride_pos, part, mask=hd_mask)
                tl.store(Part_lse + b * stride_plb + heads * stride_plh + split, lse, mask=h_mask)
                # The last program to count itself in merges. On the GPU one elected thread performs a scalar
                # atomic, so each side takes two steps. Writers: the barrier orders every thread's partial stores
                # before that thread's atomic, whose release (gpu scope, cumulative) publishes them. Merger: its
                # acquire sees every earlier release, and the barrier after it orders all its threads' reads
                # (from L2, see _merge_splits) after that acquire. No program waits for another, so any
                # scheduling order is safe, and the counter is zero again when the launch ends. The interpreter
                # runs programs one at a time, highest split last, so tests cannot exercise these orderings.
                tl.debug_barrier()
                counter = Split_counters + b * num_kv_heads + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == num_splits - 1:
                    tl.debug_barrier()
                    _merge_splits(
                        Part_out, Part_lse, Out, b * stride_plb + heads * stride_plh,
                        b * stride_pob + heads * stride_poh, b * stride_ob + heads * stride_oh, h_mask, offs_d,
                        d_mask, num_splits, stride_pos, BLOCK_H, BLOCK_D, MAX_SPLITS,
                    )
                    # Every split of this launch has counted in, so nothing else touches the counter now;
                    # the launch boundary makes the zero visible to the next layer's launch.
                    tl.store(counter, 0)


def alloc_decode_partials(
    batch_size: int, num_heads: int, max_kv_splits: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for multi-split requests: partial outputs [bs, heads, splits, head_dim] and their lse
    [bs, heads, splits]."""
    part_out = torch.empty(
        (batch_size, num_heads, max_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((batch_size, num_heads, max_kv_splits), dtype=torch.float32, device=device)
    return part_out, part_lse


def alloc_split_counters(batch_size: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """Arrival counters for the in-kernel merge: [bs * kv_heads] int32, zero. decode_attention leaves them
    zero again, so allocate once (before capturing CUDA graphs) and reuse them for every layer and step;
    only calls that run one after another (one stream) may share them."""
    return torch.zeros(batch_size * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor | None,
    max_kv_splits: int,
    sm_scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    tiles: DecodeTiles | None = None,
    split_counters: torch.Tensor | None = None,
    split_tokens: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rope: DecodeRope | None = None,
    grid_splits: int = 0,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> torch.Tensor:
    """Attention of q [bs, heads * head_dim] over each request's first seq_lens[i] positions.

    k_buffer/v_buffer: one layer's pool, [slots, kv_heads, head_dim]; out: [bs, heads * head_dim] (written);
    num_kv_splits: [bs] int32 from kv_splits_per_request, or None: each program derives its request's count
    from seq_lens with the same arithmetic (kv_splits_per_request's with min_tokens_per_split, or with
    split_tokens fixed_size_kv_splits'), which saves the launches that would fill the tensor; part_out/part_lse: alloc_decode_partials scratch
    with at least bs rows and max_kv_splits splits; split_counters: alloc_split_counters(>= bs, kv_heads).
    Without split_counters, a max_kv_splits above 1 allocates zeroed counters on every call (a memset).
    split_tokens > 0 (a multiple of the tiles' block_n): split s covers positions [s, s + 1) x split_tokens,
    so num_kv_splits must be cdiv(seq_lens, split_tokens) (fixed_size_kv_splits) and max_kv_splits at least
    its largest value; 0: the splits share each sequence evenly (kv_splits_per_request).
    k_scale / v_scale: a float8 pool's scales (the keys and values are the stored ones times these).
    rope: q/k norm, rotary and the new tokens' KV store done by this launch (DecodeRope); without it q is
    already rotated and the pool already holds every position.
    grid_splits: programs per (request, kv_head), each walking splits s, s + grid_splits, ... (0: max_kv_splits,
    one split each). Fewer programs than splits change nothing in the result: a lone long request needs
    max_kv_splits of them, but a batch of 256 launching 64 each mostly starts programs that exit at once.
    One launch; never syncs with the host.
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
    if max_kv_splits < 1 or max_kv_splits & (max_kv_splits - 1):
        raise ValueError(f"max_kv_splits must be a power of two, got {max_kv_splits}")
    if split_counters is None:
        # With one split the counters are never touched; any int32 pointer will do.
        split_counters = (
            torch.empty(1, dtype=torch.int32, device=q.device)
            if max_kv_splits == 1
            else alloc_split_counters(batch_size, num_kv_heads, q.device)
        )
    elif (
        split_counters.dtype != torch.int32
        or not split_counters.is_contiguous()
        or split_counters.numel() < batch_size * num_kv_heads
    ):
        raise ValueError(
            f"split_counters must be contiguous int32 with >= {batch_size * num_kv_heads} elements, got "
            f"{split_counters.dtype} {tuple(split_counters.shape)}"
        )
    tiles = tiles or tiles_for(batch_size)
    if split_tokens < 0 or split_tokens % tiles.block_n:
        raise ValueError(
            f"split_tokens must be 0 or a multiple of block_n {tiles.block_n}, got {split_tokens}"
        )
    if num_kv_splits is None and min_tokens_per_split < 1:
        raise ValueError(f"min_tokens_per_split must be >= 1, got {min_tokens_per_split}")
    grid_splits = grid_splits or max_kv_splits
    if not 1 <= grid_splits <= max_kv_splits:
        raise ValueError(f"grid_splits must be between 1 and max_kv_splits {max_kv_splits}, got {grid_splits}")
    q3 = q.view(batch_size, num_heads, head_dim)
    o3 = out.view(batch_size, num_heads, head_dim)
    group = num_heads // num_kv_heads
    grid = (
        (num_kv_heads, batch_size, grid_splits) if tiles.head_major else (batch_size, num_kv_heads, grid_splits)
    )
    r = rope_operands(rope, batch_size, num_kv_heads, head_dim, q3)
    pdl = launch_options(q.device)
    _decode_kernel[grid](
        q3,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        seq_lens if num_kv_splits is None else num_kv_splits,  # (not read when SPLITS_FROM_LENS)
        o3,
        part_out,
        part_lse,
        split_counters,
        r.positions,
        r.k,
        r.v,
        r.cos_cache,
        r.sin_cache,
        r.q_weight,
        r.k_weight,
        r.out_cache_loc,
        r.eps,
        1.0 / k_scale,
        1.0 / v_scale,
        r.k.stride(0),
        r.k.stride(1),
        r.v.stride(0),
        r.v.stride(1),
        r.cos_cache.stride(0),
        r.sin_cache.stride(0),
        sm_scale * k_scale * _LOG2E,
        v_scale,
        q3.stride(0),
        q3.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        o3.stride(0),
        o3.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        MAX_SPLITS=max_kv_splits,
        DOT_PRECISION=dot_precision(q.dtype),
        HEAD_MAJOR=tiles.head_major,
        K_ROWS=tiles.k_rows,
        SPLIT_TOKENS=split_tokens,
        SPLITS_FROM_LENS=0 if num_kv_splits is not None else split_tokens or min_tokens_per_split,
        ROPE=rope is not None,
        HAS_NORM=rope is not None and rope.q_weight is not None,
        FP8_MAX=fp8_max(k_buffer.dtype) if rope is not None else 0.0,
        PDL=pdl_mode(pdl),
        **pdl,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out

