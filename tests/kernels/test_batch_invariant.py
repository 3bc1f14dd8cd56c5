"""Deterministic inference's pieces, each checked for batch invariance bit for bit: the Triton product
(kernels/batch_invariant.py, under the interpreter), the CPU products and elementwise functions
(layers/batch_invariant.py), fixed-size decode splits, and both deterministic attention backends (a
request's every token gets the same output prefilled whole, in chunks beside other requests, or decoded
in batches of any size)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import WIDE_ROWS, MatmulTiles, matmul, tiles_for
from kernels.decode_attention import (
    DecodeTiles,
    alloc_decode_partials,
    decode_attention,
    fixed_size_kv_splits,
)
from kernels.reference import decode_attention_ref
from kernels.split_reduce import ticket_counters
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.deterministic_torch import DeterministicTorchAttnBackend
from services.worker.runtime.attention.deterministic_triton import DeterministicTritonAttnBackend
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.layers.attention import RadixAttention
from services.worker.runtime.layers.batch_invariant import elementwise, invariant_linear
from services.worker.runtime.layers.cpu_prepack import (
    cpu_prepack_available,
    cpu_prepack_dtypes,
    prepack_weight,
)
from tests.kernels.conftest import PagedKV, rel_error

BATCH_SIZES = (3, 17, 64)
SMALL_TILES = MatmulTiles(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)


def _alone_and_batched(fn, x: torch.Tensor, rows: tuple[int, ...] = (0, 5, 16, 40, 63)) -> None:
    """fn on each of `rows` of x alone equals that row of fn on the BATCH_SIZES-row batch holding it (at
    different positions in the batch and in the kernel's row tiles), bit for bit."""
    for i in rows:
        alone = fn(x[i : i + 1])[0]
        for bs in BATCH_SIZES:
            start = i // bs * bs
            batched = fn(x[start : start + bs])[i - start]
            assert torch.equal(batched, alone), f"row {i} differs in a batch of {bs}"


# Whole K tiles in bfloat16, a ragged last one in float32.
@pytest.mark.parametrize(("dtype", "k"), [(torch.bfloat16, 96), (torch.float32, 75)])
def test_triton_matmul_row_is_the_same_alone_and_in_batches(gen, row_dot, dtype, k) -> None:
    w = torch.randn((40, k), generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn((64, k), generator=gen).to(dtype)
    out = matmul(x, w, bias, tiles=SMALL_TILES)
    assert out.dtype == dtype and out.shape == (64, 40)
    assert rel_error(out.float(), x.float() @ w.float().t() + bias.float()) < (
        1e-6 if dtype == torch.float32 else 1e-2
    )
    _alone_and_batched(lambda rows: matmul(rows, w, bias, tiles=SMALL_TILES), x)


# K split three ways (the last split ragged in float32): each split's part and their sum in split order
# are a row's own, so the split product is batch-invariant too, and near the unsplit one.
@pytest.mark.parametrize(("dtype", "k"), [(torch.bfloat16, 192), (torch.float32, 150)])
def test_split_k_matmul_row_is_the_same_alone_and_in_batches(gen, row_dot, dtype, k) -> None:
    split = replace(SMALL_TILES, split_k=3)
    w = torch.randn((40, k), generator=gen).to(dtype)
    x = torch.randn((64, k), generator=gen).to(dtype)
    out = matmul(x, w, tiles=split)
    ref = x.float() @ w.float().t()
    assert rel_error(out.float(), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    _alone_and_batched(lambda rows: matmul(rows, w, tiles=split), x)
    assert torch.equal(ticket_counters("cpu"), torch.zeros_like(ticket_counters("cpu")))


# The split walked by one program (a prefill chunk's launch) adds the same parts in the same order as
# the split launch (a decode step's): every row the same bits either way, and so alone or batched.
@pytest.mark.parametrize(("dtype", "k"), [(torch.bfloat16, 192), (torch.float32, 150)])
def test_split_k_walked_in_one_program_is_the_split_launch_bit_for_bit(gen, row_dot, dtype, k) -> None:
    split = replace(SMALL_TILES, split_k=3)
    w = torch.randn((40, k), generator=gen).to(dtype)
    x = torch.randn((48, k), generator=gen).to(dtype)
    spread = matmul(x, w, tiles=split, splits_in_program=False)
    walked = matmul(x, w, tiles=split, splits_in_program=True)
    assert torch.equal(walked.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       spread.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    if dtype == torch.float32:
        # Not the unsplit product's bits (the ranges' sums are rounded apart), so the check above can
        # fail; in bfloat16 the output's rounding hides the difference.
        assert not torch.equal(walked, matmul(x, w, tiles=SMALL_TILES))
    _alone_and_batched(lambda rows: matmul(rows, w, tiles=split, splits_in_program=rows.shape[0] > 1), x,
                       rows=(0, 17, 40))


def test_wide_batches_take_128_row_tiles_with_the_same_bits(gen, row_dot) -> None:
    """From WIDE_ROWS rows the default launch takes 128-row tiles (the same columns, K walk and split); each
    row is the one it is alone (64-row tiles), with and without a split over K."""
    for n, k in ((48, 64), (40, 1024)):  # (40, 1024): tiles_for splits K two ways
        w = torch.randn((n, k), generator=gen).bfloat16()
        x = torch.randn((WIDE_ROWS + 44, k), generator=gen).bfloat16()
        wide = matmul(x, w)
        for i in (0, 131, WIDE_ROWS + 43):
            assert torch.equal(matmul(x[i : i + 1], w)[0], wide[i]), (n, k, i)


def test_tiles_depend_on_the_weight_shape_only() -> None:
    # A 0.6B model's o_proj / down_proj (N = 1024): 64-column tiles and K split four ways; wide weights
    # keep the warpgroup tile unsplit.
    assert tiles_for(1024, 2048) == MatmulTiles(block_n=64, split_k=4)
    assert tiles_for(1024, 3072) == MatmulTiles(block_n=64, split_k=4)
    assert tiles_for(151936, 1024) == MatmulTiles()
    assert tiles_for(1024, 600) == MatmulTiles(block_n=64)  # too little K to split


def test_triton_matmul_reads_strided_rows_and_keeps_leading_dims(gen, row_dot) -> None:
    w = torch.randn((24, 32), generator=gen)
    wide = torch.randn((2, 5, 48), generator=gen)
    x = wide[..., 8:40]  # rows 48 apart
    assert torch.equal(
        matmul(x, w, tiles=SMALL_TILES), torch.stack([matmul(x[i], w, tiles=SMALL_TILES) for i in range(2)])
    )
    assert rel_error(matmul(x, w, tiles=SMALL_TILES), x @ w.t()) < 1e-6


def test_triton_matmul_rejects_what_it_cannot_compute(gen) -> None:
    w = torch.randn((8, 16), generator=gen)
    with pytest.raises(ValueError, match=r"weight must be \[N, 12\]"):
        matmul(torch.randn((2, 12), generator=gen), w)
    with pytest.raises(ValueError, match="share a dtype"):
        matmul(torch.randn((2, 16), generator=gen).bfloat16(), w)
    with pytest.raises(ValueError, match="K axis must be contiguous"):
        matmul(torch.randn((2, 8), generator=gen), w.t())
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        matmul(torch.randn((2, 16), generator=gen), w, tiles=replace(SMALL_TILES, split_k=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_invariant_linear_row_is_the_same_alone_and_in_batches(gen, dtype, packed) -> None:
    if packed and not (cpu_prepack_available() and dtype in cpu_prepack_dtypes()):
        pytest.skip(f"oneDNN cannot prepack {dtype} weights on this CPU")
    w = torch.randn((200, 96), generator=gen).to(dtype)
    x = torch.randn((64, 96), generator=gen).to(dtype)
    weight_packed = prepack_weight(w) if packed else None
    out = invariant_linear(x, w, None, weight_packed)
    assert rel_error(out.float(), x.float() @ w.float().t()) < (1e-5 if dtype == torch.float32 else 1e-2)
    _alone_and_batched(lambda rows: invariant_linear(rows, w, None, weight_packed), x)


def test_cpu_elementwise_silu_is_the_same_wherever_the_element_sits(gen) -> None:
    # 61 features: a row's last elements fall in torch's scalar tail for some batch sizes and not others.
    x = torch.randn((64, 61), generator=gen)
    assert rel_error(elementwise(F.silu, x), F.silu(x)) < 1e-6
    _alone_and_batched(lambda rows: elementwise(F.silu, rows), x)


def test_fixed_size_decode_splits_make_a_request_the_same_in_any_batch(gen) -> None:
    seq_lens = [5, 70, 64, 1, 33, 17, 66, 45]
    kv = PagedKV(gen, seq_lens, num_kv_heads=2, head_dim=16)
    q = torch.randn((len(seq_lens), 4 * 16), generator=gen)
    tiles, split_tokens, scale = DecodeTiles(block_n=16), 32, 0.25

    def run(index: list[int], max_splits: int, grid_splits: int = 0) -> torch.Tensor:
        rows = torch.tensor(index)
        lens = kv.seq_lens[rows]
        part_out, part_lse = alloc_decode_partials(len(index), 4, max_splits, 16, "cpu")
        out = torch.empty((len(index), 64))
        decode_attention(
            q[rows], kv.k_buffer, kv.v_buffer, out, kv.req_to_token, kv.req_pool_indices[rows], lens,
            fixed_size_kv_splits(lens, split_tokens), max_splits, scale, part_out, part_lse, tiles,
            split_tokens=split_tokens, grid_splits=grid_splits,
        )  # fmt: skip
        return out

    # Alone each request gets the smallest grid that holds its splits; batched, the batch's (or more).
    alone = torch.cat(
        [run([i], 1 << max(0, (n - 1) // split_tokens).bit_length()) for i, n in enumerate(seq_lens)]
    )
    ref = decode_attention_ref(
        q, kv.k_buffer, kv.v_buffer, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, scale
    )
    assert rel_error(alone, ref) < 1e-5
    # A grid narrower than the splits (each program walking several, as the deterministic backend
    # launches large batches) gives the same bits as well.
    for bs, max_splits, grid_splits in ((3, 4, 0), (len(seq_lens), 8, 0), (len(seq_lens), 8, 1), (3, 4, 3)):
        starts = range(0, len(seq_lens), bs)
        batched = torch.cat(
            [run(list(range(s, min(s + bs, len(seq_lens)))), max_splits, grid_splits) for s in starts]
        )
        assert torch.equal(batched, alone)


def test_decode_rejects_a_split_size_off_the_tile(gen) -> None:
    kv = PagedKV(gen, [10], num_kv_heads=1, head_dim=16)
    q = torch.randn((1, 16), generator=gen)
    part_out, part_lse = alloc_decode_partials(1, 1, 1, 16, "cpu")
    with pytest.raises(ValueError, match="multiple of block_n 16"):
        decode_attention(
            q, kv.k_buffer, kv.v_buffer, torch.empty((1, 16)), kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
            torch.ones(1, dtype=torch.int32), 1, 1.0, part_out, part_lse, DecodeTiles(block_n=16), split_tokens=40,
        )  # fmt: skip


class _Steps:
    """A fresh pool, request table and slot allocator, and one attention layer, for running steps of a
    scenario. Every (request, position) has fixed q / k / v rows, so a token's inputs are the same in any
    run, whichever rows and slots the run gives it."""

    heads, head_dim = 4, 16

    def __init__(
        self, backend: AttentionBackend, qkv: dict[str, tuple[torch.Tensor, ...]], rows: dict[str, int]
    ) -> None:
        self.kv_heads = qkv["r"][1].shape[1] // self.head_dim
        self.backend, self.qkv, self.rows = backend, qkv, rows
        self.req_pool = ReqToTokenPool(size=8, max_context_len=160, device="cpu")
        self.allocator = TokenToKVPoolAllocator(size=600, device="cpu")
        self.kv_pool = TokenToKVPool(600, 1, self.kv_heads, self.head_dim, torch.float32, "cpu")
        self.layer = RadixAttention(self.heads, self.head_dim, self.head_dim**-0.5, self.kv_heads, 0)
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def step(self, parts: list[tuple[str, int, int]], decode: bool = False) -> None:
        """One forward of (request, first position, new tokens) parts; records each token's output."""
        locs, positions, q, k, v = [], [], [], [], []
        for name, start, n in parts:
            # The allocator's order varies with the scenario, so a token's slot differs between runs.
            slots = self.allocator.alloc(n)
            assert slots is not None
            self.req_pool.write(self.rows[name], start, slots)
            locs.append(slots)
            positions.append(torch.arange(start, start + n))
            for out, table in zip((q, k, v), self.qkv[name]):
                out.append(table[start : start + n])
        seq_lens = [start + n for _, start, n in parts]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(parts),
            input_ids=torch.zeros(sum(n for _, _, n in parts), dtype=torch.int64),
            positions=torch.cat(positions),
            req_pool_indices=torch.tensor([self.rows[name] for name, _, _ in parts], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=[start for _, start, _ in parts],
            extend_seq_lens_cpu=[n for _, _, n in parts],
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(batch)
        out = self.layer(torch.cat(q), torch.cat(k), torch.cat(v), batch)
        row = 0
        for name, start, n in parts:
            for i in range(n):
                self.outputs[(name, start + i)] = out[row + i]
            row += n


def _scenarios(
    make_backend, gen: torch.Generator, length: int, kv_heads: int
) -> list[dict[tuple[str, int], torch.Tensor]]:
    """Request "r" (`length` tokens) run three ways: prefilled alone in one step; in chunks of 7 beside
    "a" (its first 20 tokens in r's first step, then one token per step); prefilled to half its length,
    then decoded one token per step beside one or two other decoding requests (r first, last or between)."""
    half, chunks = length // 2, -(-length // 7)
    width, kv_width = _Steps.heads * _Steps.head_dim, kv_heads * _Steps.head_dim
    lengths = {"r": length, "a": 20 + chunks, "b": 10 + length - half, "c": 10 + length - half}
    qkv = {
        name: (torch.randn((n, width), generator=gen), torch.randn((n, kv_width), generator=gen),
               torch.randn((n, kv_width), generator=gen))
        for name, n in lengths.items()
    }  # fmt: skip
    alone = _Steps(make_backend(), qkv, {"r": 5})
    alone.step([("r", 0, length)])

    chunked = _Steps(make_backend(), qkv, {"a": 1, "r": 3})
    chunked.step([("a", 0, 20), ("r", 0, 7)])
    for start in range(7, length, 7):
        chunked.step([("a", 20 + start // 7 - 1, 1), ("r", start, min(7, length - start))])

    decoded = _Steps(make_backend(), qkv, {"b": 0, "c": 2, "r": 6})
    decoded.step([("b", 0, 10), ("r", 0, half), ("c", 0, 5)])
    for pos in range(half, length):
        others = [("b", 10 + pos - half, 1)] + ([("c", 5 + (pos - half) // 2, 1)] if pos % 2 else [])
        parts = [*others, ("r", pos, 1)] if pos % 3 else [("r", pos, 1), *others]
        decoded.step(parts, decode=True)
    return [s.outputs for s in (alone, chunked, decoded)]


@pytest.mark.parametrize("backend", ["torch", "triton", "triton, 8 tokens a block"])
def test_deterministic_attention_is_the_same_prefilled_chunked_or_decoded(gen, row_dot, backend) -> None:
    if backend == "torch":  # two 64-key tiles, grouped query heads
        length, runs = 90, _scenarios(DeterministicTorchAttnBackend, gen, 90, kv_heads=2)
    else:  # two 16-key splits of one 16-key tile each (the interpreter is slow)
        # One KV head: a group of 4, 4 tokens a block in extend; two: a group of 2, 8 tokens a block.
        length, kv_heads = 24, (2 if "8 tokens" in backend else 1)
        runs = _scenarios(lambda: DeterministicTritonAttnBackend(32, 16, DecodeTiles(block_n=16)), gen, 24, kv_heads)
    alone, chunked, decoded = runs
    positions = [key for key in alone if key[0] == "r"]
    assert len(positions) == length
    for key in positions:
        assert torch.equal(chunked[key], alone[key]), f"chunked prefill differs at position {key[1]}"
        assert torch.equal(decoded[key], alone[key]), f"decode differs at position {key[1]}"
