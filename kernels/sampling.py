"""Gumbel-max sampling over the whole vocabulary in one read of the logits.

For each row i it returns argmax_j scaled[i, j] + g(seeds[i], positions[i], j), where g is exactly the
sampler's `gumbel_noise` (services/worker/runtime/sampling/sampler.py): splitmix64 on 64-bit integers with
wrap-around, the top 23 bits as u = (k + 0.5) / 2**23, g = -log(-log(u)) in float32. The torch form
builds that noise in about twenty elementwise passes over [bs, V] int64 tensors; here each program
hashes its own tile of token ids in registers, adds the noise to the logits it loaded and keeps the
tile's best (score, token id) in a [bs, tiles] scratch, and a second tiny launch picks each row's best
tile (none when one tile covers the row). Ties go to the lowest token id and a row that is all -inf gives
token 0, as with torch.argmax, so both forms choose the same token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# splitmix64 constants (Steele et al.); above 2**63, so Triton types them uint64.
_GAMMA = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)
_TWO_POW_MINUS_23 = tl.constexpr(2.0**-23)


@triton.jit
def _mix64(z):
    # On uint64, >> is a logical shift and * wraps mod 2**64, as splitmix64 needs.
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


@triton.jit
def _row_key(Seeds, Positions, row):
    seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
    position = tl.load(Positions + row).to(tl.uint64, bitcast=True)
    return _mix64(_mix64(seed) + position * _GAMMA)


@triton.jit
def _uniform(row_key, cols):
    """u in (0, 1) for token ids `cols` (non-negative int32), bit-identical to sampler.hashed_uniform."""
    bits = _mix64(row_key + cols.to(tl.uint64) * _GAMMA) >> 41
    return (bits.to(tl.int32).to(tl.float32) + 0.5) * _TWO_POW_MINUS_23


@triton.jit
def _tile_argmax_kernel(
    Scaled,
    Seeds,
    Positions,
    Tile_best,
    Tile_token,
    vocab,
    stride_row,
    stride_col,
    n_tiles,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    offsets = row.to(tl.int64) * stride_row + cols.to(tl.int64) * stride_col
    x = tl.load(Scaled + offsets, mask=mask, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(_uniform(_row_key(Seeds, Positions, row), cols)))
    # Padding lanes hold -inf and sit above every real lane, so the lowest-index tie-break never picks one.
    best, at = tl.max(x + gumbel, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Tile_best + row * n_tiles + tile, best)
    tl.store(Tile_token + row * n_tiles + tile, tile * BLOCK + at)


@triton.jit
def _row_argmax_kernel(Tile_best, Tile_token, Out, n_tiles, BLOCK_TILES: tl.constexpr):
    row = tl.program_id(0)
    tiles = tl.arange(0, BLOCK_TILES)
    best = tl.load(Tile_best + row * n_tiles + tiles, mask=tiles < n_tiles, other=float("-inf"))
    # Tiles are in token order, so the first best tile holds the lowest best token id.
    _, tile = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Out + row, tl.load(Tile_token + row * n_tiles + tile))


@triton.jit
def _uniform_kernel(Seeds, Positions, Out, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(_row_key(Seeds, Positions, row), cols)
    tl.store(Out + row.to(tl.int64) * vocab + cols, u, mask=cols < vocab)


def _keys(
    seeds: torch.Tensor, positions: torch.Tensor, bs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.shape != (bs,) or t.dtype != torch.int64 or t.device != device:
            raise ValueError(f"{name}: expected an int64 [{bs}] tensor on {device}")
    return seeds.contiguous(), positions.contiguous()


def gumbel_argmax(
    scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block: int = 4096
) -> torch.Tensor:
    """scaled [bs, V] (float; any strides, e.g. a row slice of a wider buffer), seeds and positions
    [bs] int64 -> int64 [bs]: each row's argmax of scaled + gumbel_noise(seeds, positions, token ids).
    `block` is the tile width (a power of two), the number of token ids one program hashes."""
    if scaled.dim() != 2:
        raise ValueError(f"scaled: expected [bs, V], got shape {tuple(scaled.shape)}")
    bs, vocab = scaled.shape
    seeds, positions = _keys(seeds, positions, bs, scaled.device)
    block = min(block, triton.next_power_of_2(vocab))
    n_tiles = triton.cdiv(vocab, block)
    tile_best = torch.empty((bs, n_tiles), dtype=torch.float32, device=scaled.device)
    tile_token = torch.empty((bs, n_tiles), dtype=torch.int64, device=scaled.device)
    if bs == 0:
        return tile_token.view(bs)
    _tile_argmax_kernel[(bs, n_tiles)](
        scaled,
        seeds,
        positions,
        tile_best,
        tile_token,
        vocab,
        scaled.stride(0),
        scaled.stride(1),
        n_tiles,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    if n_tiles == 1:
        return tile_token.view(bs)
    out = torch.empty(bs, dtype=torch.int64, device=scaled.device)
    _row_argmax_kernel[(bs,)](
        tile_best, tile_token, out, n_tiles, BLOCK_TILES=triton.next_power_of_2(n_tiles), num_warps=1
    )
    return out


@triton.jit
def _greedy_keys(x, cols):
    """int64 keys ordered as torch.argmax ranks (value, token id): the value's float32 bits made monotone
    (any NaN above +inf, -0.0 equal to +0.0) in the high half, 2**32 - 1 - id in the low half, so the
    largest key is the first maximal token."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)
    low = tl.full((), 4294967295, tl.int64) - cols.to(tl.int64)
    return ordered.to(tl.int64) * 4294967296 + low


@triton.jit
def _greedy_token(key):
    return tl.full((), 4294967295, tl.int64) - (key & tl.full((), 4294967295, tl.int64))


@triton.jit
def _greedy_kernel(
    Logits, Tile_keys, Counters, Out, vocab, stride_row, stride_col, n_tiles, BLOCK: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(Logits + row.to(tl.int64) * stride_row + cols.to(tl.int64) * stride_col, mask=mask, other=0.0)
    # Lanes past the vocabulary take the smallest key, below any real token's.
    keys = tl.where(mask, _greedy_keys(x.to(tl.float32), cols), -9223372036854775807 - 1)
    best = tl.max(keys, axis=0)
    if n_tiles == 1:
        tl.store(Out + row, _greedy_token(best))
    else:
        tl.store(Tile_keys + row * n_tiles + tile, best)
        # The last tile of the row to count itself in merges, as decode attention merges its splits
        # (kernels/decode_attention.py): the barrier orders each thread's store before the release, the
        # merger reads from L2 (.cg) after its acquire, and leaves the counter zero for the next call.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + row, 1, sem="acq_rel", scope="gpu")
        if arrived == n_tiles - 1:
            tl.debug_barrier()
            tiles = tl.arange(0, BLOCK_TILES)
            all_keys = tl.load(
                Tile_keys + row * n_tiles + tiles, mask=tiles < n_tiles, other=-9223372036854775807 - 1,
                cache_modifier=".cg",
            )
            tl.store(Out + row, _greedy_token(tl.max(all_keys, axis=0)))
            tl.store(Counters + row, 0)


_greedy_counters: dict[torch.device, torch.Tensor] = {}


def _counters(rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed arrival counters, one a row, kept per device: every launch leaves them zero again, so calls
    on one stream reuse them."""
    held = _greedy_counters.get(device)
    if held is None or held.numel() < rows:
        held = torch.zeros(max(rows, 256), dtype=torch.int32, device=device)
        _greedy_counters[device] = held
    return held


def greedy_argmax(logits: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """logits [bs, V] (float; any strides) -> int64 [bs]: torch.argmax(logits, dim=-1) exactly (the first
    index of a row's maximum, a NaN counting as the maximum, an empty-of-values row impossible: V >= 1), in
    one launch of bs x ceil(V / block) programs. Calls must not run concurrently on two streams of one
    device (they share the row counters)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [bs, V] with V >= 1, got shape {tuple(logits.shape)}")
    if logits.shape[1] >= 2**31:
        raise ValueError("greedy_argmax takes fewer than 2**31 columns")
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    block = min(block, triton.next_power_of_2(vocab))
    n_tiles = triton.cdiv(vocab, block)
    tile_keys = torch.empty((bs, n_tiles), dtype=torch.int64, device=logits.device)
    _greedy_kernel[(bs, n_tiles)](
        logits, tile_keys, _counters(bs, logits.device), out, vocab, logits.stride(0), logits.stride(1), n_tiles,
        BLOCK=block, BLOCK_TILES=triton.next_power_of_2(n_tiles), num_warps=4,
    )
    return out


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms `gumbel_argmax` draws, as float32 [bs, vocab], to check them bit for bit against
    the sampler's torch `hashed_uniform` (tests/kernels/test_sampling.py, bench/gpu_kernels.py)."""
    bs = seeds.shape[0]
    seeds, positions = _keys(seeds, positions, bs, seeds.device)
    out = torch.empty((bs, vocab), dtype=torch.float32, device=seeds.device)
    if bs and vocab:
        block = min(1024, triton.next_power_of_2(vocab))
        _uniform_kernel[(bs, triton.cdiv(vocab, block))](seeds, positions, out, vocab, BLOCK=block)
    return out
