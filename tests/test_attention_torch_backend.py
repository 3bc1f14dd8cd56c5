"""The torch backend's decode attention against a naive attention over every K/V written so far, through
each way it reads keys: dense blocks kept across decode steps (rebuilt when the batch changes, outgrows
them, or a request's earlier slots change), a gather from the pool (a request in several rows, or a
batch over the blocks' memory budget), and the C++ batch op reading the pool through the slots (float32
with kernels/cpu/matvec.cpp built; the other tests turn it off with RS_CPU_ROW_ATTENTION=0); extend
through SDPA and, on AVX-512, kernels/cpu/extend_attention.cpp (RS_CPU_EXTEND_ATTENTION=0 off)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_matvec
from kernels.cpu_matvec import EXTEND_ATTENTION_ENV
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from services.worker.runtime.attention.torch_backend import (
    ROW_ATTENTION_ENV,
    DecodeMetadata,
    ExtendMetadata,
    TorchAttnBackend,
)
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.layers.attention import RadixAttention
from tests.forward_helpers import step_batch

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 16


class _Requests:
    """Requests on one pool and the torch backend: each step writes fresh random q/k/v for its new
    tokens, and every layer's output is checked against a naive attention over the K/V each request
    has accumulated (kept here, outside the pool)."""

    def __init__(self, backend: TorchAttnBackend, gen: torch.Generator) -> None:
        self.backend, self.gen = backend, gen
        self.req_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu")
        self.allocator = TokenToKVPoolAllocator(size=1024, device="cpu")
        self.kv_pool = TokenToKVPool(1024, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
        self.layers = [
            RadixAttention(NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS, i) for i in range(NUM_LAYERS)
        ]
        # Per request row: its K and V per layer, [positions, kv_heads, head_dim].
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def new_request(self) -> int:
        row = self.req_pool.alloc(1)[0]
        empty = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)
        self.keys[row], self.values[row] = [empty] * NUM_LAYERS, [empty] * NUM_LAYERS
        return row

    def length(self, row: int) -> int:
        return self.keys[row][0].shape[0]

    def extend(self, rows: list[int], counts: list[int]) -> ForwardBatch:
        prefix = [self.length(r) for r in rows]
        return self._step(ForwardMode.EXTEND, rows, prefix, counts)

    def decode(self, rows: list[int]) -> ForwardBatch:
        """One new token per row; a row repeated takes the request's next positions, as speculative
        verification sends them (every row stores its K/V before any attends)."""
        positions: list[int] = []
        for i, row in enumerate(rows):
            positions.append(self.length(row) + rows[:i].count(row))
        return self._step(ForwardMode.DECODE, rows, positions, [1] * len(rows))

    def _step(self, mode: ForwardMode, rows: list[int], prefix: list[int], counts: list[int]) -> ForwardBatch:
        slots = self.allocator.alloc(sum(counts))
        assert slots is not None
        tokens = sum(counts)
        batch = step_batch(
            mode,
            rows,
            prefix,
            list(slots.split(counts)),
            torch.zeros(tokens, dtype=torch.int64),
            self.req_pool,
            self.kv_pool,
            self.backend,
        )
        for layer in self.layers:
            q = torch.randn((tokens, NUM_HEADS * HEAD_DIM), generator=self.gen)
            k = torch.randn((tokens, NUM_KV_HEADS * HEAD_DIM), generator=self.gen)
            v = torch.randn((tokens, NUM_KV_HEADS * HEAD_DIM), generator=self.gen)
            out = layer(q, k, v, batch)
            k, v = k.view(tokens, NUM_KV_HEADS, HEAD_DIM), v.view(tokens, NUM_KV_HEADS, HEAD_DIM)
            # Every row's K/V is stored before any row attends: extend the histories first.
            start = 0
            for row, n in zip(rows, counts):
                lid = layer.layer_id
                self.keys[row][lid] = torch.cat([self.keys[row][lid], k[start : start + n]])
                self.values[row][lid] = torch.cat([self.values[row][lid], v[start : start + n]])
                start += n
            start = 0
            for row, p, n in zip(rows, prefix, counts):
                for j in range(n):
                    ref = _naive_attention(
                        q[start + j],
                        self.keys[row][layer.layer_id][: p + j + 1],
                        self.values[row][layer.layer_id][: p + j + 1],
                    )
                    assert torch.allclose(out[start + j], ref, rtol=1e-5, atol=1e-5), (mode, row, p + j)
                start += n
        return batch


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [heads * head_dim] over keys/values [n, kv_heads, head_dim], in float64; query head h uses KV
    head h // (heads / kv_heads)."""
    group = NUM_HEADS // NUM_KV_HEADS
    q = q.double().view(NUM_KV_HEADS, group, HEAD_DIM)
    k, v = keys.double().transpose(0, 1), values.double().transpose(0, 1)  # [kv_heads, n, head_dim]
    weights = (q @ k.transpose(1, 2) * HEAD_DIM**-0.5).softmax(dim=-1)  # [kv_heads, group, n]
    return (weights @ v).reshape(-1).float()


def _meta(batch: ForwardBatch) -> DecodeMetadata:
    assert isinstance(batch.attn_metadata, DecodeMetadata)
    return batch.attn_metadata


def _filled(batch: ForwardBatch) -> bool:
    """Whether this dense step gathered the blocks (False: it appended the new tokens)."""
    dense = _meta(batch).dense
    assert dense is not None, "the step should read dense blocks"
    return dense.fill_slots is not None


@pytest.fixture
def reqs(monkeypatch: pytest.MonkeyPatch) -> _Requests:
    monkeypatch.setenv(ROW_ATTENTION_ENV, "0")  # the float32 pool would take the C++ batch op
    monkeypatch.setenv(EXTEND_ATTENTION_ENV, "0")  # and, on AVX-512, the C++ prefill op
    return _Requests(TorchAttnBackend(), torch.Generator().manual_seed(0))


def test_float32_batches_attend_in_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        cpu_matvec.load_matvec()
    except cpu_matvec.MatvecUnavailable as exc:
        pytest.skip(f"the C++ library is not built here: {exc}")
    monkeypatch.setenv(ROW_ATTENTION_ENV, "1")
    reqs = _Requests(TorchAttnBackend(), torch.Generator().manual_seed(3))
    a, b, c = (reqs.new_request() for _ in range(3))
    reqs.extend([a, b, c], [5, 13, 2])
    for rows in ([a, b, c], [c, a], [a, a, a, b], [b, c]):  # batches change; a in several rows
        for _ in range(3):
            meta = _meta(reqs.decode(rows))  # each layer checked against the naive attention
            assert meta.rows and meta.head_rows is None
            # Over the dense blocks where the batch has them, else over the pool's slots.
            assert (meta.dense is None) == (rows == [a, a, a, b])
            assert (meta.row_slots is None) == (meta.dense is None)
    assert reqs.length(a) == 5 + 3 + 3 + 9


def _needs_extend_op() -> None:
    """Skip unless the C++ prefill op (kernels/cpu/extend_attention.cpp) serves this CPU."""
    try:
        cpu_matvec.load_matvec()
    except cpu_matvec.MatvecUnavailable as exc:
        pytest.skip(f"the C++ library is not built here: {exc}")
    if cpu_matvec.extend_attention() is None:
        pytest.skip("the C++ prefill op serves AVX-512 CPUs only")


def test_float32_prefill_attends_in_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_extend_op()
    monkeypatch.setenv(ROW_ATTENTION_ENV, "0")
    reqs = _Requests(TorchAttnBackend(), torch.Generator().manual_seed(4))
    a, b, c = (reqs.new_request() for _ in range(3))
    # Fresh prompts, continued ones beside fresh ones, single new tokens: each layer checked against the
    # naive attention over every key so far.
    for rows, counts in (([a, b], [9, 70]), ([a, c, b], [6, 1, 33]), ([c, a], [40, 1])):
        meta = reqs.extend(rows, counts).attn_metadata
        assert isinstance(meta, ExtendMetadata) and meta.rows is not None
    assert reqs.length(a) == 16 and reqs.length(b) == 103 and reqs.length(c) == 41


def test_bfloat16_queries_over_a_float32_pool_take_the_sdpa_loop() -> None:
    """The C++ prefill op takes float32 queries only; other queries over a float32 pool get the SDPA loop's
    own metadata and naive attention's output (within bfloat16 rounding)."""
    _needs_extend_op()
    gen = torch.Generator().manual_seed(6)
    reqs = _Requests(TorchAttnBackend(), gen)
    a = reqs.new_request()
    slots = reqs.allocator.alloc(7)
    assert slots is not None
    batch = step_batch(
        ForwardMode.EXTEND, [a], [0], [slots], torch.zeros(7, dtype=torch.int64), reqs.req_pool, reqs.kv_pool,
        reqs.backend,
    )  # fmt: skip
    q = torch.randn((7, NUM_HEADS * HEAD_DIM), generator=gen).bfloat16()
    k = torch.randn((7, NUM_KV_HEADS * HEAD_DIM), generator=gen).bfloat16()
    v = torch.randn((7, NUM_KV_HEADS * HEAD_DIM), generator=gen).bfloat16()
    out = reqs.layers[0](q, k, v, batch)
    assert out.dtype == torch.bfloat16
    keys, values = k.float().view(7, NUM_KV_HEADS, HEAD_DIM), v.float().view(7, NUM_KV_HEADS, HEAD_DIM)
    for j in range(7):
        ref = _naive_attention(q[j].float(), keys[: j + 1], values[: j + 1])
        torch.testing.assert_close(out[j].float(), ref, rtol=3e-2, atol=3e-2)


def test_decode_appends_to_dense_blocks_and_regathers_as_they_fill(reqs: _Requests) -> None:
    reqs.backend.dense.headroom = 8  # small blocks: several rebuilds for growth within the test
    rows = [reqs.new_request() for _ in range(3)]
    reqs.extend(rows, [5, 13, 2])  # unequal lengths: the masked path
    filled = [_filled(reqs.decode(rows)) for _ in range(40)]
    assert filled[0], "the first decode step gathers the blocks"
    # Capacity is the longest length rounded up to 8, plus 8 to 16: 2 or 3 rebuilds in 40 steps.
    assert 2 <= sum(filled[1:]) <= 3


def test_dense_blocks_follow_the_batch_as_it_changes(reqs: _Requests) -> None:
    a, b, c = (reqs.new_request() for _ in range(3))
    reqs.extend([a, b, c], [4, 9, 6])
    assert _filled(reqs.decode([a, b, c]))
    assert not _filled(reqs.decode([a, b, c]))
    assert _filled(reqs.decode([a, c]))  # b left the batch
    assert not _filled(reqs.decode([a, c]))
    assert _filled(reqs.decode([c, a]))  # the same requests in another order
    d = reqs.new_request()
    reqs.extend([d], [7])  # any other forward drops the blocks
    assert _filled(reqs.decode([c, a]))
    assert _filled(reqs.decode([c, a, d]))
    assert not _filled(reqs.decode([c, a, d]))


def test_a_request_whose_earlier_slot_changed_is_regathered(reqs: _Requests) -> None:
    a, b = reqs.new_request(), reqs.new_request()
    reqs.extend([a, b], [6, 6])
    assert _filled(reqs.decode([a, b]))
    # Position 2 of request a now lives in another slot holding other K/V (as when a slot is freed
    # and taken again): the next step, one token longer as usual, must not trust the blocks.
    moved = reqs.allocator.alloc(1)
    assert moved is not None
    reqs.req_pool.write(a, 2, moved)
    for layer_id in range(NUM_LAYERS):
        for store, history in ((reqs.kv_pool.k_buffer, reqs.keys), (reqs.kv_pool.v_buffer, reqs.values)):
            fresh = torch.randn((NUM_KV_HEADS, HEAD_DIM), generator=reqs.gen)
            store[layer_id][moved] = fresh
            history[a][layer_id] = history[a][layer_id].clone()
            history[a][layer_id][2] = fresh
    assert _filled(reqs.decode([a, b]))
    assert not _filled(reqs.decode([a, b]))


def test_a_request_in_several_rows_gathers_from_the_pool(reqs: _Requests) -> None:
    a, b = reqs.new_request(), reqs.new_request()
    reqs.extend([a, b], [5, 3])
    assert _filled(reqs.decode([a, b]))
    batch = reqs.decode([a, a, a, b])  # three rows of a, as speculative verification sends them
    assert _meta(batch).dense is None and _meta(batch).head_rows is not None
    assert _filled(reqs.decode([a, b]))  # the blocks were dropped


def test_a_batch_over_the_memory_budget_gathers_from_the_pool(reqs: _Requests) -> None:
    reqs.backend.dense.max_bytes = 1
    rows = [reqs.new_request() for _ in range(3)]
    reqs.extend(rows, [3, 8, 5])
    for _ in range(3):
        batch = reqs.decode(rows)
        assert _meta(batch).dense is None and _meta(batch).head_rows is not None


def test_a_lone_request_with_consecutive_slots_reads_a_view_of_the_pool(reqs: _Requests) -> None:
    a = reqs.new_request()
    reqs.extend([a], [7])
    for _ in range(3):
        batch = reqs.decode([a])
        assert _meta(batch).first_slot == 1 and _meta(batch).dense is None


def test_extend_with_and_without_a_cached_prefix_matches_naive_attention(reqs: _Requests) -> None:
    a, b = reqs.new_request(), reqs.new_request()
    reqs.extend([a], [9])  # a fresh prompt: is_causal, no mask
    reqs.extend([a, b], [6, 11])  # a continues its prompt (masked) beside b's fresh one (causal)
    reqs.extend([b, a], [1, 4])  # one new token sees every key
    assert reqs.length(a) == 19 and reqs.length(b) == 12


def test_extend_runs_the_fused_cpu_attention_kernel(reqs: _Requests) -> None:
    a, b = reqs.new_request(), reqs.new_request()
    reqs.extend([a], [5])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        reqs.extend([a, b], [7, 8])
    kernels = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    assert kernels == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
