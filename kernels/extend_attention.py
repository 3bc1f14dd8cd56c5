"""Extend (prefill) attention: new tokens attend to their cached prefix and causally to each other.

Many requests of different lengths go in one launch. Request i owns rows qo_indptr[i] ..
qo_indptr[i+1]-1 of q / k_new / v_new; its new tokens sit after prefix_lens[i] cached positions whose
K/V are read from the pool through req_to_token.

The grid is (q head, block table entry). The host lists every BLOCK_M-row query block of the batch as
(request index, first new-token row within the request), heaviest first (extend_block_table: the
blocks that visit the most keys start first, so the short ones fill the tail of the launch). The table
may be longer than the batch needs: entries with request index -1 return at once. So the launch depends
on the table's length alone, not on the requests' lengths, and a CUDA graph captured with a table long
enough for any batch of its token bucket replays every such batch. Each program runs one online
softmax in two phases:

1. the prefix, read from the pool through req_to_token, with no mask (every new token sees all of it);
2. the new tokens themselves, read straight from k_new / v_new (no gather), with the causal mask, and
   only up to the block's last row, so the upper triangle costs nothing.

The query heads of one KV head are adjacent in the grid, so their K/V tiles are reused from L2.

Split prefixes. A program walks its block's whole prefix, so a short chunk after a long prefix (a
mixed step late in a long prompt: one or two blocks x the heads) keeps a few SMs busy for as long as
the prefix takes. The table can therefore give a block several entries, each walking one contiguous
part of the prefix (the last one also the new tokens). Such entries write their normalized partial
output and log-sum-exp to a scratch slot and count themselves in on the group's counter; the last to
arrive merges the group into `out` and zeroes the counter (as decode_attention does). The host decides
the splits (extend_block_table), so a CUDA graph replays any split the table it was given describes.

A float8 pool (services/worker/mem/memory_pool.py): the prefix is read as stored and converted to q's
dtype, the K scale folded into the softmax scale and the V scale multiplying the output. The new tokens'
K/V tiles are rounded through the pool's float8 as they are read (kv_store.to_pool, bit for bit what
the pool holds for them), so a token attends to the same keys whether they were stored in an earlier
step (a cached prefix, an earlier chunk) or come with this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.decode_attention import dot_precision
from kernels.kv_store import fp8_max, to_pool

_LOG2E = 1.4426950408889634
# Rows of a block table: request index, first new-token row, split index, splits of the block, and the
# entry's scratch slot (-1 when the block is not split).
TABLE_ROWS = 5
# A table entry the kernel skips (no request), as padding.
PAD_ENTRY = (-1, 0, 0, 1, -1)
# extend_block_table splits a block's prefix only into parts of at least this many keys.
MIN_KEYS_PER_SPLIT = 512


@dataclass(frozen=True)
class ExtendTiles:
    """Launch shape. The default suits Hopper with head_dim 128: 128-row query blocks over 8 warps
    (two warpgroups, so tl.dot can use the warpgroup MMA) and 64-key tiles, double-buffered."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold a tile of base-2 scores s [M, N] (masked entries -inf) and its values v [N, D] in."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q,
    K_new,
    V_new,
    Out,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Qo_indptr,
    Block_table,
    Part_out,
    Part_lse,
    Split_counters,
    sm_scale_log2,
    v_scale,
    inv_k_scale,
    inv_v_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_r2t,
    stride_bt,
    stride_pos,
    stride_poh,
    stride_pom,
    stride_pls,
    stride_plh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    head = tl.program_id(0)
    entry = tl.program_id(1)
    b = tl.load(Block_table + entry)
    if b >= 0:
        block_start = tl.load(Block_table + stride_bt + entry)
        split = tl.load(Block_table + 2 * stride_bt + entry)
        num_splits = tl.load(Block_table + 3 * stride_bt + entry)
        kv_head = head // GROUP
        q_start = tl.load(Qo_indptr + b)
        extend_len = tl.load(Qo_indptr + b + 1) - q_start
        prefix_len = tl.load(Prefix_lens + b)
        req_row = tl.load(Req_pool_indices + b).to(tl.int64)

        offs_m = block_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # This entry's part of the prefix: whole tiles per split, the last part shorter.
        part_len = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        p_lo = split * part_len
        p_hi = tl.minimum(prefix_len, p_lo + part_len)
        token_row = Req_to_token + req_row * stride_r2t
        for n0 in range(p_lo, p_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < p_hi
            slots = tl.load(token_row + pos, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(
                K_buf + slots[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            ).to(q.dtype)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
            s = tl.where(n_mask[None, :], s, float("-inf"))
            v = tl.load(
                V_buf + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(q.dtype)
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

        # The new tokens: the last split's part.
        if split == num_splits - 1:
            # New tokens before this block are visible to every row: no mask at all (BLOCK_M is a multiple
            # of BLOCK_N and the table's first rows are multiples of BLOCK_M, so these tiles end exactly at
            # the block's first row).
            for n0 in range(0, block_start, BLOCK_N):
                kv_rows = (q_start + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
                k = tl.load(
                    K_new + kv_rows[None, :] * stride_knt + kv_head * stride_knh + offs_d[:, None],
                    mask=d_mask[:, None],
                    other=0.0,
                )
                if FP8_MAX > 0:
                    k = to_pool(k, inv_k_scale, K_buf, FP8_MAX).to(q.dtype)
                s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
                v = tl.load(
                    V_new + kv_rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=d_mask[None, :],
                    other=0.0,
                )
                if FP8_MAX > 0:
                    v = to_pool(v, inv_v_scale, V_buf, FP8_MAX).to(q.dtype)
                acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

            # The diagonal tiles, causally masked; keys past the block's last row are masked for every
            # row, so the loop stops there.
            causal_end = tl.minimum(extend_len, block_start + BLOCK_M)
            for n0 in range(block_start, causal_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < extend_len
                kv_rows = (q_start + offs_n).to(tl.int64)
                k = tl.load(
                    K_new + kv_rows[None, :] * stride_knt + kv_head * stride_knh + offs_d[:, None],
                    mask=n_mask[None, :] & d_mask[:, None],
                    other=0.0,
                )
                if FP8_MAX > 0:
                    k = to_pool(k, inv_k_scale, K_buf, FP8_MAX).to(q.dtype)
                s = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
                s = tl.where((offs_n[None, :] <= offs_m[:, None]) & n_mask[None, :], s, float("-inf"))
                v = tl.load(
                    V_new + kv_rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                if FP8_MAX > 0:
                    v = to_pool(v, inv_v_scale, V_buf, FP8_MAX).to(q.dtype)
                acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

        if num_splits == 1:
            # Every row saw at least its own key, so l_i > 0.
            out = acc / l_i[:, None] * v_scale
            tl.store(
                Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                out.to(Out.dtype.element_ty),
                mask=m_mask[:, None] & d_mask[None, :],
            )
        else:
            # An empty part (no keys: only possible for a table built by hand) has lse -inf and weighs 0.
            has_keys = l_i > 0
            part = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            slot = tl.load(Block_table + 4 * stride_bt + entry)
            offs_r = tl.arange(0, BLOCK_M)
            part_rows = Part_out + head * stride_poh + offs_r[:, None] * stride_pom + offs_d[None, :]
            tl.store(part_rows + slot * stride_pos, part, mask=d_mask[None, :])
            lse_rows = Part_lse + head * stride_plh + offs_r
            tl.store(lse_rows + slot * stride_pls, lse)
            # Count in on the group's counter (release), the last arrival merges (acquire), as in
            # decode_attention: no program waits for another, and the counter is zero again after.
            tl.debug_barrier()
            first_slot = slot - split
            counter = Split_counters + first_slot * tl.num_programs(0) + head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for j in range(num_splits):
                    m = tl.maximum(m, tl.load(lse_rows + (first_slot + j) * stride_pls, cache_modifier=".cg"))
                m = tl.where(m > float("-inf"), m, 0.0)
                merged = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                total = tl.zeros([BLOCK_M], dtype=tl.float32)
                for j in range(num_splits):
                    w = tl.exp2(tl.load(lse_rows + (first_slot + j) * stride_pls, cache_modifier=".cg") - m)
                    got = tl.load(
                        part_rows + (first_slot + j) * stride_pos, mask=d_mask[None, :], other=0.0,
                        cache_modifier=".cg",
                    )
                    merged += got * w[:, None]
                    total += w
                out = merged / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(
                    Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                    out.to(Out.dtype.element_ty),
                    mask=m_mask[:, None] & d_mask[None, :],
                )
                tl.store(counter, 0)


def _heads_view(x: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    """[tokens, heads * head_dim] (row stride free) -> [tokens, heads, head_dim] view."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous")
    return x.view(x.shape[0], -1, head_dim) if x.dim() == 2 else x


def extend_block_table(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    block_m: int,
    num_blocks: int | None = None,
    *,
    num_heads: int = 1,
    num_sms: int = 0,
    max_split_slots: int = 0,
    min_keys_per_split: int | None = None,
) -> torch.Tensor:
    """The launch's block table, on the host: int32 [TABLE_ROWS, num_blocks]; column j = (request index,
    first new-token row within the request, split index, splits of that block, scratch slot or -1) of
    one entry.

    Every block_m-row query block gets one entry. With num_sms > 0, a launch takes at least its heaviest
    entry's time and its total work (keys visited) over its lanes, the 2 num_sms / num_heads entries
    whose programs run at once. So while the heaviest entry outweighs a lane's share and scratch slots
    remain (max_split_slots; a split block takes one per part), that block's prefix is split once more,
    as long as each part keeps min_keys_per_split keys (default MIN_KEYS_PER_SPLIT). A mixed step's 32
    one-row decode blocks beside one chunk after a 30k prefix are as slow as that chunk's programs
    unless it is split. Entries are ordered by the keys they visit, most first, ties in batch order.
    num_blocks (default: exactly the entries there are) pads the table with PAD_ENTRY, which the kernel
    skips; it must hold every block, and splitting stops where it is full.
    """
    if min_keys_per_split is None:
        min_keys_per_split = MIN_KEYS_PER_SPLIT
    blocks: list[tuple[int, int, int, int]] = []  # (request, first row, prefix, new tokens visited)
    for i, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
        for start in range(0, n, block_m):
            blocks.append((i, start, prefix, min(n, start + block_m)))
    if num_blocks is not None and num_blocks < len(blocks):
        raise ValueError(f"num_blocks {num_blocks} is below the {len(blocks)} query blocks of the batch")
    splits = [1] * len(blocks)
    # Only blocks whose prefix makes two parts can split: usually a handful, so the loop stays cheap
    # beside a batch of many short blocks (it runs on the host before every extend step).
    candidates = [j for j, b in enumerate(blocks) if b[2] >= 2 * min_keys_per_split] if num_sms > 0 else []
    room = len(blocks) + max_split_slots if num_blocks is None else num_blocks  # entries the table may hold
    lanes = max(1, 2 * num_sms // max(1, num_heads))
    share = sum(prefix + visited for _, _, prefix, visited in blocks) / lanes
    entries, slots = len(blocks), 0
    while candidates and entries < room:
        best, best_work = -1, share
        for j in candidates:
            prefix, visited = blocks[j][2], blocks[j][3]
            can_split = slots + (2 if splits[j] == 1 else 1) <= max_split_slots
            can_split &= prefix // (splits[j] + 1) >= min_keys_per_split
            if can_split and prefix / splits[j] + visited > best_work:
                best, best_work = j, prefix / splits[j] + visited
        if best < 0:
            break
        slots += 2 if splits[best] == 1 else 1
        splits[best] += 1
        entries += 1
    columns: list[tuple[int, int, int, int, int]] = []
    work: list[float] = []
    next_slot = 0
    for j, (i, start, prefix, visited) in enumerate(blocks):
        n = splits[j]
        for part in range(n):
            slot = next_slot + part if n > 1 else -1
            columns.append((i, start, part, n, slot))
            work.append(prefix / n + (visited if part == n - 1 else 0))
        if n > 1:
            next_slot += n
    num_blocks = len(columns) if num_blocks is None else num_blocks
    table = torch.tensor(PAD_ENTRY, dtype=torch.int32)[:, None].repeat(1, num_blocks)
    if columns:
        # sorted() is stable with reverse=True: equal work keeps batch order.
        order = sorted(range(len(columns)), key=work.__getitem__, reverse=True)
        table[:, : len(columns)] = torch.tensor([columns[j] for j in order], dtype=torch.int32).T
    return table


def alloc_extend_partials(
    max_split_slots: int, num_heads: int, block_m: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for split entries: partial outputs [slots, heads, block_m, head_dim] and their lse
    [slots, heads, block_m] (float32), and the merge's arrival counters [slots * heads] (int32, zero;
    extend_attention leaves them zero, so allocate once and reuse on one stream)."""
    slots = max(1, max_split_slots)
    part_out = torch.empty((slots, num_heads, block_m, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((slots, num_heads, block_m), dtype=torch.float32, device=device)
    counters = torch.zeros(slots * num_heads, dtype=torch.int32, device=device)
    return part_out, part_lse, counters


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_table: torch.Tensor,
    sm_scale: float,
    tiles: ExtendTiles | None = None,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [tokens, heads * d]; k_new/v_new [tokens, kv_heads * d]; out [tokens, heads * d] (written at
    the rows of the requests' new tokens; rows past qo_indptr[-1] are left as they are).
    partials: alloc_extend_partials' scratch, with at least as many slots and as many heads as the
    table uses and tiles.block_m rows; required when the table splits a block (it is not checked on the
    device: a split table without it writes through a dummy pointer).

    k_buffer/v_buffer: one layer's pool [slots, kv_heads, d]; prefix_lens [bs] and qo_indptr [bs + 1]
    (int32, device) give each request's cached length and its rows; block_table [2, num_blocks] (int32,
    device, each row contiguous) is extend_block_table's for these lengths and tiles.block_m, possibly
    padded: its length sizes the grid. k_scale / v_scale: a float8 pool's scales (its keys and values
    are the stored ones times these; k_new / v_new are rounded through the pool's float8 as read).
    """
    tiles = tiles or ExtendTiles()
    if tiles.block_m % tiles.block_n:
        raise ValueError(f"tiles: block_m {tiles.block_m} must be a multiple of block_n {tiles.block_n}")
    head_dim = k_buffer.shape[2]
    num_kv_heads = k_buffer.shape[1]
    q3 = _heads_view(q, head_dim, "q")
    k3 = _heads_view(k_new, head_dim, "k_new")
    v3 = _heads_view(v_new, head_dim, "v_new")
    o3 = _heads_view(out, head_dim, "out")
    num_heads = q3.shape[1]
    if num_heads % num_kv_heads or k3.shape[1] != num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("k_buffer/v_buffer: the head_dim axis must be contiguous")
    batch_size = prefix_lens.shape[0]
    if qo_indptr.shape[0] != batch_size + 1:
        raise ValueError(f"qo_indptr must have {batch_size + 1} entries, got {qo_indptr.shape[0]}")
    if block_table.dim() != 2 or block_table.shape[0] != TABLE_ROWS or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be [{TABLE_ROWS}, num_blocks] with contiguous rows, got {tuple(block_table.shape)}"
        )
    if partials is None:
        # Never touched by a table without splits; any float32 / int32 tensors will do as pointers.
        dummy_f = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        part_out, part_lse, counters = dummy_f, dummy_f[0], torch.empty(1, dtype=torch.int32, device=q.device)
    else:
        part_out, part_lse, counters = partials
        if part_out.shape[1] < q3.shape[1] or part_out.shape[2] != tiles.block_m or part_out.shape[3] != head_dim:
            raise ValueError(
                f"partials {tuple(part_out.shape)} do not fit {q3.shape[1]} heads, block_m {tiles.block_m}, "
                f"head_dim {head_dim}"
            )
    num_blocks = block_table.shape[1]
    if num_blocks == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (num_heads, num_blocks)
    _extend_kernel[grid](
        q3,
        k3,
        v3,
        o3,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        qo_indptr,
        block_table,
        part_out,
        part_lse,
        counters,
        sm_scale * k_scale * _LOG2E,
        v_scale,
        1.0 / k_scale,
        1.0 / v_scale,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        o3.stride(0),
        o3.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        FP8_MAX=fp8_max(k_buffer.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
