"""How the fused MoE's (token, expert) pairs fill the grouped GEMMs' row blocks (kernels/fused_moe.py).

Each BLOCK_M-row block of the two GEMMs belongs to one expert. Two layouts:
- sorted (align_tokens_by_expert): the pairs ordered by expert (by pair id within one), each expert's
  run padded to a multiple of BLOCK_M. Every expert's weights are read once per block of its pairs. On
  CUDA one Triton launch lays it out (it was 28 small torch launches, bench/cpu_moe_launches.py):
  1. every program counts the pairs per expert (tl.histogram over all of them; the ids are a few KB,
     read from L2) and, apart, those before its own pairs;
  2. an exclusive scan of the padded counts gives each expert's run;
  3. a pair's slot is its run's start plus the number of earlier pairs of its expert: the counts
     before the program's pairs, carried from tile to tile, plus a pairwise compare within a tile;
  4. each program fills its share of the blocks: the block's expert and the sentinel in padding rows.
  Every output element is written by exactly one program, so nothing is zeroed first; sizes follow
  from the shapes alone (CUDA-graph safe, no host sync). Off CUDA the torch ops are the path and the
  reference (align_tokens_by_expert_torch); both give the same tensors, bit for bit.
- one pair per block (one_pair_per_block): pair p alone in block p, at row 0. The layout is the
  shape's own, so the GEMM kernel derives it from its program id and reads the expert of block p from
  topk_ids itself: no launch at all before the GEMMs. Two pairs of one expert then read its weights
  twice, so this is for decode-sized batches only.

Plus the launch shapes (MoeTiles) the two GEMMs run with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The one-pair-per-block layout's limit on T * k, past one token (see one_pair_per_block).
DECODE_MAX_PAIRS = 64

# The sorted layout's kernel. Its histograms and scans hold one lane per expert, hence a limit on E.
ALIGN_MAX_EXPERTS = 1024
_HIST_TILE = 1024  # ids per tl.histogram in the counting pass
# Pairs ranked at once (a [128, 128] compare): as many as the 4 warps have threads, so that in the
# default layout no thread holds a copy of another's id in the tile's histogram (replicated inputs are
# where tl.histogram has had bugs; bench/gpu_moe_routing.py checks the kernel against torch on a GPU).
_PAIR_TILE = 128
_ALIGN_WARPS = 4
_ALIGN_PROGRAMS = 128  # at most; every program counts all the pairs, so more would repeat that work


@dataclass(frozen=True)
class MoeTiles:
    """One grouped GEMM's launch shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Deterministic inference: one launch shape whatever the batch (moe_tiles_for's choice varies with it).
DETERMINISTIC_MOE_TILES = MoeTiles()


def moe_tiles_for(num_pairs: int, num_experts: int, fp8: bool = False) -> MoeTiles:
    """Few pairs per expert (decode): short row blocks, so padding does not multiply the work; the
    kernel then streams weights, and a narrow N with a long K keeps many loads in flight.

    FP8 experts get their own: each K step's scaled product needs registers of its own beside the two
    accumulators of the gated GEMM, and the bf16 tiles spilled with it when compiled for sm90 (checked
    offline with ptxas; these do not)."""
    if fp8:
        if num_pairs <= 2 * num_experts:
            return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=8, num_stages=3)
        if num_pairs <= 16 * num_experts:
            return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoeTiles(block_m=64, block_n=64, block_k=128, num_warps=8, num_stages=3)
    if num_pairs <= 2 * num_experts:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if num_pairs <= 16 * num_experts:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return MoeTiles()


def one_pair_per_block(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether fused_moe gives every pair a block of its own (no sorting launches) by default.

    One token: always. Its k experts are distinct (top-k), so the sorted layout would hold one pair per
    block too: the same blocks, the same weight reads, minus the sort.

    More tokens: while T * k <= min(DECODE_MAX_PAIRS, E / 4). Two pairs that share an expert cost a
    second read of its weights; with uniform routing the expected share of such reads is about
    (T - 1) k / 2E < T k / 2E, at most 1/8 under E / 4 (Qwen3.5-35B-A3B, 256 experts top-8: up to 8
    tokens; Qwen3-30B-A3B, 128 top-8: 4). The cap of 64 pairs bounds the extra bytes where E is large:
    at 35B-A3B's 6 MB bf16 experts, 1/8 of 64 reads is ~8 extra (~10 us at 4.8 TB/s), less than the
    sort's 28 launches cost even inside a CUDA graph (~1 us or more each, estimated, not measured).
    The sort is one Triton launch now (bench/gpu_moe_routing.py times it); these limits were set
    against the 28 and have not been revisited. Skewed routing shares more experts; the cap keeps that
    case small too.
    """
    if num_tokens <= 1:
        return True
    return num_tokens * top_k <= min(DECODE_MAX_PAIRS, num_experts // 4)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """A ValueError for ids that are not integers, or (off CUDA, where reading them costs no sync) not
    experts. On CUDA both layouts assert a bad id under TRITON_DEBUG=1; otherwise the sorted layout
    leaves its pair out of every block (the pair's output rows stay unwritten) and the other reads
    out of bounds."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.is_cuda or topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got ids from {low} to {high}")


def _check_align_args(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    check_expert_ids(topk_ids, num_experts)


def _max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout whatever the routing: every expert's run can end block_m - 1 short."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def align_tokens_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded) for topk_ids [T, k].

    sorted_ids [max_padded] int32: pair ids grouped by expert, by pair id within an expert, each expert's
    run padded to a multiple of block_m with the sentinel T*k (and the unused tail filled with it too);
    expert_ids [max_padded / block_m] int32: the expert of each block (-1 past the end); num_padded [1]
    int32: rows in use. max_padded depends on the shapes only, so the call can be captured in a CUDA graph.

    One Triton launch on CUDA (align_tokens_by_expert_kernel), torch ops elsewhere (the reference,
    align_tokens_by_expert_torch); both give the same tensors."""
    _check_align_args(topk_ids, num_experts, block_m)
    if topk_ids.is_cuda and num_experts <= ALIGN_MAX_EXPERTS:
        return align_tokens_by_expert_kernel(topk_ids, num_experts, block_m)
    return align_tokens_by_expert_torch(topk_ids, num_experts, block_m)


def align_tokens_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_tokens_by_expert in torch ops (about 28 launches on CUDA, none of them a host sync)."""
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    device = flat.device
    # scatter_add rather than bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_start = counts.cumsum(0) - counts
    rank = torch.arange(n, device=device) - run_start[sorted_experts]
    dest = (padded_end - padded_counts)[sorted_experts] + rank
    max_padded = _max_padded(n, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _load_experts(Ids, pairs, end, num_experts):
    """(expert of each pair, 0 where not valid; valid: the pair is below end and its id in [0, E))."""
    e = tl.load(Ids + pairs, mask=pairs < end, other=0)
    valid = (pairs < end) & (e >= 0) & (e < num_experts)
    return tl.where(valid, e, 0).to(tl.int32), valid


@triton.jit
def _moe_align_kernel(
    Ids,
    Sorted_ids,
    Expert_ids,
    Num_padded,
    num_pairs,
    num_experts,
    block_m,
    num_blocks,
    pairs_per_program,
    blocks_per_program,
    BLOCK_E: tl.constexpr,
    HIST_TILE: tl.constexpr,
    PAIR_TILE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The sorted layout, one program per run of pairs_per_program pairs and of blocks_per_program blocks.
    Every slot of Sorted_ids and Expert_ids is written once, by one program: no races, no zeroing."""
    pid = tl.program_id(0)
    first = pid * pairs_per_program
    last = tl.minimum(first + pairs_per_program, num_pairs)
    # 1. Every program counts all the pairs per expert, and those before its own apart.
    hist = tl.arange(0, HIST_TILE)
    before = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, first, HIST_TILE):
        e, valid = _load_experts(Ids, start + hist, first, num_experts)
        before += tl.histogram(e, BLOCK_E, mask=valid)
    counts = before
    for start in range(first, num_pairs, HIST_TILE):
        e, valid = _load_experts(Ids, start + hist, num_pairs, num_experts)
        counts += tl.histogram(e, BLOCK_E, mask=valid)
    # 2. Expert e's run: [run_start, run_end), its counts[e] pairs then padding up to a multiple of block_m.
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = tl.cumsum(padded, 0)
    run_start = run_end - padded
    tl.store(Num_padded, tl.sum(padded, 0), mask=pid == 0)
    # 3. This program's pairs, in order: a pair's slot is its run's start plus the number of earlier pairs
    # of its expert (those of earlier programs and tiles in cursor, those of its tile counted pairwise).
    cursor = run_start + before
    lanes = tl.arange(0, PAIR_TILE)
    for start in range(first, last, PAIR_TILE):
        pairs = start + lanes
        e, valid = _load_experts(Ids, pairs, last, num_experts)
        tl.device_assert(valid | (pairs >= last), "expert id outside [0, E)")
        earlier = (e[:, None] == e[None, :]) & valid[None, :] & (lanes[None, :] < lanes[:, None])
        slot = tl.gather(cursor, e, 0) + tl.sum(earlier.to(tl.int32), 1)
        tl.store(Sorted_ids + slot, pairs, mask=valid)
        cursor += tl.histogram(e, BLOCK_E, mask=valid)
    # 4. This program's blocks: each one's expert (how many runs end at or before it, E past the last)
    # and the sentinel in its rows past the expert's pairs.
    experts = tl.arange(0, BLOCK_E)
    blocks_end = tl.where(experts < num_experts, run_end // block_m, num_blocks)
    pairs_end = run_start + counts
    rows = tl.arange(0, BLOCK_M)
    first_block = pid * blocks_per_program
    last_block = tl.minimum(first_block + blocks_per_program, num_blocks)
    for start in range(first_block, last_block, BLOCK_B):
        blocks = start + tl.arange(0, BLOCK_B)
        expert = tl.sum((blocks_end[None, :] <= blocks[:, None]).to(tl.int32), 1)
        in_use = expert < num_experts
        mine = blocks < last_block
        tl.store(Expert_ids + blocks, tl.where(in_use, expert, -1), mask=mine)
        end = tl.where(in_use, tl.gather(pairs_end, tl.minimum(expert, num_experts - 1), 0), 0)
        slots = blocks[:, None] * block_m + rows[None, :]
        padding = (slots >= end[:, None]) & (rows[None, :] < block_m) & mine[:, None]
        tl.store(Sorted_ids + slots, tl.zeros([BLOCK_B, BLOCK_M], tl.int32) + num_pairs, mask=padding)


def align_tokens_by_expert_kernel(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_tokens_by_expert in one Triton launch (any device Triton runs on, the interpreter included).

    Ids outside [0, E) raise a ValueError off CUDA; on CUDA (no sync to read them) they are left out of
    every block, and TRITON_DEBUG=1 asserts them instead."""
    _check_align_args(topk_ids, num_experts, block_m)
    if num_experts > ALIGN_MAX_EXPERTS:
        raise ValueError(f"num_experts must be at most {ALIGN_MAX_EXPERTS} for the kernel, got {num_experts}")
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    if num_pairs == 0:  # nothing to sort, and Triton takes no pointer to an empty CUDA tensor
        return align_tokens_by_expert_torch(topk_ids, num_experts, block_m)
    max_padded = _max_padded(num_pairs, num_experts, block_m)
    if max_padded >= 2**31:
        raise ValueError(f"{num_pairs} pairs are too many for one call (int32 slots): split the batch")
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=flat.device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=flat.device)
    # Programs: one per PAIR_TILE pairs up to _ALIGN_PROGRAMS, past that several tiles each (every
    # program counts all the pairs, so more programs would repeat that work more than they save).
    pair_tiles = max(1, triton.cdiv(num_pairs, _PAIR_TILE))
    pairs_per_program = triton.cdiv(pair_tiles, min(pair_tiles, _ALIGN_PROGRAMS)) * _PAIR_TILE
    programs = max(1, triton.cdiv(num_pairs, pairs_per_program))
    block_e = max(32, triton.next_power_of_2(num_experts))
    block_rows = triton.next_power_of_2(block_m)
    _moe_align_kernel[(programs,)](
        flat,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        block_m,
        num_blocks,
        pairs_per_program,
        triton.cdiv(num_blocks, programs),
        BLOCK_E=block_e,
        HIST_TILE=_HIST_TILE,
        PAIR_TILE=_PAIR_TILE,
        BLOCK_B=max(1, 8192 // max(block_e, block_rows)),
        BLOCK_M=block_rows,
        num_warps=_ALIGN_WARPS,
    )
    return sorted_ids, expert_ids, num_padded
