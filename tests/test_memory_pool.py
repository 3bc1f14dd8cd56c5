"""KV memory pools: slot and row accounting against a set-based model, table read/write, KV buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator

SIZE = 16


def _free_slots(allocator: TokenToKVPoolAllocator) -> list[int]:
    """The allocator's free slots, read through its public API (drain, then give back)."""
    slots = allocator.alloc(allocator.available_size())
    assert slots is not None
    allocator.free(slots)
    return sorted(slots.tolist())


def test_allocator_hands_out_slots_one_to_size_never_zero() -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    slots = allocator.alloc(SIZE)
    assert slots is not None
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert sorted(slots.tolist()) == list(range(1, SIZE + 1))
    assert allocator.available_size() == 0


def test_allocator_returns_none_when_exhausted_and_keeps_its_state() -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    first = allocator.alloc(SIZE - 3)
    assert first is not None
    assert allocator.alloc(4) is None
    assert allocator.available_size() == 3
    rest = allocator.alloc(3)
    assert rest is not None
    assert set(rest.tolist()).isdisjoint(first.tolist())


def test_allocator_alloc_zero_is_empty() -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    slots = allocator.alloc(0)
    assert slots is not None and slots.numel() == 0
    assert allocator.available_size() == SIZE


def test_allocator_reuses_freed_slots_and_accepts_int32_input() -> None:
    allocator = TokenToKVPoolAllocator(4, "cpu")
    slots = allocator.alloc(4)
    assert slots is not None
    allocator.free(slots[1:3].to(torch.int32))
    again = allocator.alloc(2)
    assert again is not None
    assert sorted(again.tolist()) == sorted(slots[1:3].tolist())
    assert again.dtype == torch.int64


def test_allocator_clear_makes_every_slot_free() -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    assert allocator.alloc(10) is not None
    allocator.clear()
    assert _free_slots(allocator) == list(range(1, SIZE + 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, SIZE + 2)), max_size=40))
def test_allocator_accounting_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            slots = allocator.alloc(n)
            if n > SIZE - len(held):
                assert slots is None
            else:
                assert slots is not None and slots.numel() == n
                got = slots.tolist()
                assert 0 not in got
                assert set(got).isdisjoint(held) and len(set(got)) == n
                held.extend(got)
        else:
            k = min(n, len(held))
            allocator.free(torch.tensor(held[:k], dtype=torch.int64))
            held = held[k:]
        assert allocator.available_size() == SIZE - len(held)
    assert sorted(_free_slots(allocator) + held) == list(range(1, SIZE + 1))


def test_allocator_rejects_negative_count() -> None:
    allocator = TokenToKVPoolAllocator(SIZE, "cpu")
    with pytest.raises(ValueError, match="n"):
        allocator.alloc(-1)


def test_allocator_never_hands_out_slot_zero_even_after_it_is_freed() -> None:
    # Unwritten req_to_token positions read as 0, so a caller freeing them must not poison the pool.
    allocator = TokenToKVPoolAllocator(2, "cpu")
    allocator.free(torch.zeros(1, dtype=torch.int64))
    slots = allocator.alloc(allocator.available_size())
    assert slots is not None and 0 not in slots.tolist()


def test_req_to_token_pool_rows_are_distinct_and_none_when_exhausted() -> None:
    pool = ReqToTokenPool(4, 8, "cpu")
    rows = pool.alloc(3)
    assert rows is not None and sorted(rows) == sorted(set(rows)) and all(0 <= r < 4 for r in rows)
    assert pool.alloc(2) is None
    assert pool.available_size() == 1
    pool.free(rows[0])
    assert pool.available_size() == 2
    more = pool.alloc(2)
    assert more is not None and rows[0] in more
    pool.clear()
    assert pool.available_size() == 4


def test_req_to_token_pool_rejects_negative_count() -> None:
    pool = ReqToTokenPool(4, 8, "cpu")
    with pytest.raises(ValueError, match="n"):
        pool.alloc(-1)


def test_req_to_token_pool_write_then_read_round_trips_as_int64() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    pool.write(1, 2, torch.tensor([7, 8, 9], dtype=torch.int64))
    out = pool.read(1, 0, 6)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == [0, 0, 7, 8, 9, 0]
    assert pool.read(0, 0, 6).tolist() == [0] * 6
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token[1, 2:5].tolist() == [7, 8, 9]


def test_req_to_token_pool_read_is_a_copy() -> None:
    pool = ReqToTokenPool(1, 4, "cpu")
    pool.write(0, 0, torch.tensor([1, 2]))
    out = pool.read(0, 0, 2)
    pool.write(0, 0, torch.tensor([5, 6]))
    assert out.tolist() == [1, 2]


@pytest.mark.parametrize("commit_at_start", [True, False])  # False: zero pages given on first touch
def test_token_to_kv_pool_has_a_padding_row_and_writes_at_slots(commit_at_start: bool) -> None:
    pool = TokenToKVPool(size=6, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu",
                         commit_at_start=commit_at_start)
    assert pool.get_key_buffer(0).shape == (7, 2, 4)
    assert pool.get_value_buffer(1).shape == (7, 2, 4)
    loc = torch.tensor([3, 5])
    k = torch.arange(16, dtype=torch.float32).view(2, 8)  # flattened heads are accepted
    v = -torch.arange(16, dtype=torch.float32).view(2, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k.view(2, 2, 4))
    assert torch.equal(pool.get_value_buffer(1)[loc], v)
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert pool.get_key_buffer(1)[[0, 1, 2, 4, 6]].abs().sum() == 0


def test_a_pool_committed_on_first_touch_reads_as_torch_zeros_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lazy = TokenToKVPool(size=5000, num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype, device="cpu",
                             commit_at_start=False)
        for buffer in (*lazy.k_buffer, *lazy.v_buffer):
            assert buffer.dtype == dtype and buffer.is_contiguous()
            assert torch.equal(buffer, torch.zeros(5001, 2, 64, dtype=dtype))
        lazy.set_kv_buffer(1, torch.tensor([4999]), torch.ones(1, 2, 64), torch.full((1, 2, 64), 2.0))
        assert lazy.get_value_buffer(1)[4999].eq(2).all() and lazy.get_key_buffer(1)[:4999].abs().sum() == 0


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    assert TokenToKVPool.bytes_per_token(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
    assert TokenToKVPool.bytes_per_token(1, 1, 4, torch.float32) == 2 * 4 * 4
