"""Deterministic extend attention: each new token attended as decode would attend it, with the query
tokens of one request sharing each key tile.

The deterministic backend (services/worker/runtime/attention/deterministic_triton.py) needs a token's
attention to be the same bits in a prefill, a chunk and a decode step. It used to run the decode kernel
with one "request" per new token, so a 2,048-token prompt read its keys 2,048 times (53 ms for the 28
layers of a 0.6B model on the H200).

Decode puts a KV head's query heads (the GQA group) in the rows of its `tl.dot`, padded to BLOCK_H = 16
rows: a 0.6B model's group of 2 leaves 14 rows empty. Here those rows hold the next tokens of the same
request: TOKENS = BLOCK_H // GROUP consecutive tokens per program, row i being token i // GROUP's head
i % GROUP. The products have decode's shapes ([BLOCK_H, head_dim] x [head_dim, BLOCK_N]) and a row's
result depends on its own operands only, the tiles are anchored at the same fixed split starts, a tile past
a row's own end leaves that row exactly as it was (kernels/decode_attention.py `_attend_split`), and the
splits merge in index order. So each row is decode's arithmetic over its own keys, and every key tile is
read once for TOKENS tokens.

A block is up to TOKENS consecutive tokens of one request (token_blocks). Its split count is its last
token's; a token with one split is written directly (as decode writes it), a token with more through the
merge, where the block's extra splits are empty for it (lse -inf: weight 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import _LOG2E, DecodeTiles, _attend_split, _merge_splits, dot_precision


def tokens_per_block(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens one program takes: decode's padded row count over the GQA group (at least 1)."""
    group = num_heads // num_kv_heads
    return max(1, max(16, triton.next_power_of_2(group)) // group)


def token_blocks(
    qo_indptr: torch.Tensor, num_blocks: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of up to `tokens` consecutive tokens, none crossing a segment of qo_indptr ([segments + 1]
    token offsets, on the device): each segment's blocks in order, then empty ones up to num_blocks.
    Returns (first token, token count) per block, int32 on qo_indptr's device; no host sync, so a CUDA
    graph can capture it with num_blocks a bound (sum of cdiv(segment length, tokens) at most)."""
    starts, ends = qo_indptr[:-1], qo_indptr[1:]
    per_segment = (ends - starts + tokens - 1) // tokens
    cum = torch.cumsum(per_segment, 0)
    block = torch.arange(num_blocks, dtype=cum.dtype, device=cum.device)
    owner = torch.searchsorted(cum, block, right=True)
    valid = owner < per_segment.shape[0]
    owner = owner.clamp(max=per_segment.shape[0] - 1)
    first = starts[owner] + (block - (cum[owner] - per_segment[owner])) * tokens
    count = torch.where(valid, torch.minimum(ends[owner] - first, torch.full_like(first, tokens)), 0)
    return torch.where(valid, first, 0).to(torch.int32), count.to(torch.int32)


@triton.jit
def _token_block_kernel(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_rows,
    Seq_lens,
    Num_splits,
    Block_first,
    Block_count,
    Out,
    Part_out,
    Part_lse,
    Split_counters,
    first_block,
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
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    K_ROWS: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
):
    kv_head = tl.program_id(0)
    num_kv_heads = tl.num_programs(0)
    local = tl.program_id(1)  # this launch's block; its scratch rows are local * TOKENS ...
    blk = first_block + local
    first_split = tl.program_id(2)
    count = tl.load(Block_count + blk)
    t0 = tl.load(Block_first + blk)
    # The block's splits are its last token's (the longest); clamped as decode clamps them.
    num_splits = tl.minimum(tl.maximum(tl.load(Num_splits + t0 + tl.maximum(count, 1) - 1), 1), MAX_SPLITS)
    if (count > 0) & (first_split < num_splits):
        offs_r = tl.arange(0, BLOCK_H)
        tok = offs_r // GROUP
        r_mask = (tok < count) & (tok < TOKENS)
        token = t0 + tl.where(r_mask, tok, 0)
        heads = kv_head * GROUP + offs_r % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        hd_mask = r_mask[:, None] & d_mask[None, :]
        row_len = tl.where(r_mask, tl.load(Seq_lens + token).to(tl.int32), 0)
        row_splits = tl.minimum(tl.maximum(tl.load(Num_splits + token), 1), MAX_SPLITS)
        seq_len = tl.load(Seq_lens + t0 + count - 1).to(tl.int32)
        req_row = tl.load(Req_rows + t0).to(tl.int64)
        q = tl.load(Q + token[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)
        scratch_row = local * TOKENS + tok
        out_rows = token * stride_ob + heads * stride_oh
        part_rows = scratch_row * stride_pob + heads * stride_poh
        lse_rows = scratch_row * stride_plb + heads * stride_plh
        for split in range(first_split, num_splits, tl.num_programs(2)):
            start = split * SPLIT_TOKENS
            end = tl.minimum(start + SPLIT_TOKENS, seq_len)
            row_end = tl.minimum(start + SPLIT_TOKENS, row_len)
            m_i, l_i, acc = _attend_split(
                q, K_buf, V_buf, Req_to_token + req_row * stride_r2t, start, end, row_end, kv_head, offs_d,
                d_mask, sm_scale_log2, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_H, BLOCK_D, BLOCK_N,
                DOT_PRECISION, K_ROWS, True,
            )
            has_tokens = l_i > 0
            part = acc / tl.where(has_tokens, l_i, 1.0)[:, None] * v_scale
            # A token of one split: written as decode writes it (its only split is split 0).
            direct = r_mask & (row_splits == 1) & (split == 0)
            tl.store(Out + out_rows[:, None] + offs_d[None, :], part.to(Out.dtype.element_ty), mask=direct[:, None] & d_mask[None, :])
            if num_splits > 1:
                merged = r_mask & (row_splits > 1)
                lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
                tl.store(Part_out + part_rows[:, None] + split * stride_pos + offs_d[None, :], part, mask=hd_mask)
                tl.store(Part_lse + lse_rows + split, lse, mask=r_mask)
                # As decode's merge (kernels/decode_attention.py): the last program of the block to count
                # itself in merges, and sets the counter back to zero.
                tl.debug_barrier()
                counter = Split_counters + local * num_kv_heads + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == num_splits - 1:
                    tl.debug_barrier()
                    _merge_splits(
                        Part_out, Part_lse, Out, lse_rows, part_rows, out_rows, merged, offs_d, d_mask,
                        num_splits, stride_pos, BLOCK_H, BLOCK_D, MAX_SPLITS,
                    )
                    tl.store(counter, 0)


def token_block_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    block_first: torch.Tensor,
    block_count: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    split_tokens: int,
    tiles: DecodeTiles,
    blocks: tuple[int, int] | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    grid_splits: int = 0,
) -> torch.Tensor:
    """Attention of each query token t of q [tokens, heads * head_dim] over positions 0 .. seq_lens[t] - 1
    of request row req_rows[t], as decode_attention(split_tokens=split_tokens) computes it for that token
    alone, bit for bit; written to out's row t.

    num_kv_splits: fixed_size_kv_splits(seq_lens, split_tokens); block_first / block_count: token_blocks
    with tokens_per_block(heads, kv_heads) tokens a block (a block's tokens are consecutive positions of
    one request); blocks: the range (first, end) of blocks this launch runs (default all), whose scratch
    part_out [(end - first) * TOKENS, heads, max_kv_splits, head_dim] and part_lse [..., heads,
    max_kv_splits] float32, and zeroed int32 split_counters [(end - first) * kv_heads] are allocated when
    not given (counters are left zero). Tokens in no block are not written. One launch; no host sync.
    """
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    num_heads = q.shape[-1] // head_dim if q.dim() == 2 else q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if split_tokens < 1 or split_tokens % tiles.block_n:
        raise ValueError(f"split_tokens must be a positive multiple of block_n {tiles.block_n}, got {split_tokens}")
    if max_kv_splits < 1 or max_kv_splits & (max_kv_splits - 1):
        raise ValueError(f"max_kv_splits must be a power of two, got {max_kv_splits}")
    first, end = blocks if blocks is not None else (0, block_first.shape[0])
    if not 0 <= first < end <= block_first.shape[0]:
        raise ValueError(f"blocks {blocks} out of range for {block_first.shape[0]} blocks")
    group = num_heads // num_kv_heads
    tokens = tokens_per_block(num_heads, num_kv_heads)
    rows = (end - first) * tokens
    if part_out is None or part_lse is None:
        part_out = torch.empty((rows, num_heads, max_kv_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, num_heads, max_kv_splits), dtype=torch.float32, device=q.device)
    if part_out.shape[0] < rows or part_out.shape[2] < max_kv_splits:
        raise ValueError(f"part_out {tuple(part_out.shape)} too small for {rows} rows, {max_kv_splits} splits")
    if split_counters is None:
        split_counters = torch.zeros((end - first) * num_kv_heads, dtype=torch.int32, device=q.device)
    q3 = q.view(q.shape[0], num_heads, head_dim)
    o3 = out.view(out.shape[0], num_heads, head_dim)
    grid_splits = grid_splits or max_kv_splits
    _token_block_kernel[(num_kv_heads, end - first, grid_splits)](
        q3, k_buffer, v_buffer, req_to_token, req_rows, seq_lens, num_kv_splits, block_first, block_count, o3,
        part_out, part_lse, split_counters, first, sm_scale * k_scale * _LOG2E, v_scale,
        q3.stride(0), q3.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), o3.stride(0), o3.stride(1), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        MAX_SPLITS=max_kv_splits,
        DOT_PRECISION=dot_precision(q.dtype),
        K_ROWS=tiles.k_rows,
        SPLIT_TOKENS=split_tokens,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
