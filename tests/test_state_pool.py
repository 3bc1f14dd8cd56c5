"""StatePool and HybridReqToTokenPool on their own: a request row comes with a zeroed state row of its
own and gives it back when freed; the padding row is never handed out; misuse is refused."""

from __future__ import annotations

import pytest
import torch

from services.worker.mem.state_pool import HybridReqToTokenPool, StatePool, StateShape, state_rows_for_budget

SHAPE = StateShape(num_layers=2, conv_dim=6, conv_width=4, num_v_heads=2, k_head_dim=3, v_head_dim=5,
                   conv_dtype=torch.float32)


def make_pool(rows: int = 3) -> HybridReqToTokenPool:
    return HybridReqToTokenPool(rows, 16, "cpu", StatePool(rows, SHAPE, "cpu"))


def test_each_request_row_gets_its_own_zeroed_state_row_and_returns_it() -> None:
    pool = make_pool()
    state = pool.state_pool
    for conv, recurrent in zip(state.conv_state, state.recurrent_state):
        conv.fill_(7.0)
        recurrent.fill_(7.0)
    rows = pool.alloc(3)
    assert rows is not None and pool.alloc(1) is None
    state_rows = pool.req_to_state[torch.tensor(rows)].tolist()
    assert sorted(state_rows) == [1, 2, 3]  # row 0 is the padding row
    for conv, recurrent in zip(state.conv_state, state.recurrent_state):
        assert conv[state_rows].eq(0).all() and recurrent[state_rows].eq(0).all()
        assert conv[0].eq(7.0).all()
    assert state.available_size() == 0
    pool.check_state_invariant(3)
    pool.free(rows[1])
    assert state.available_size() == 1 and pool.req_to_state[rows[1]].item() == StatePool.PAD_ROW
    pool.check_state_invariant(2)
    with pytest.raises(AssertionError, match="state pool leak"):
        pool.check_state_invariant(3)


def test_freeing_a_row_twice_is_refused() -> None:
    pool = make_pool()
    [row] = pool.alloc(1)
    pool.free(row)
    with pytest.raises(ValueError, match="holds no state row"):
        pool.free(row)


def test_clear_returns_every_row() -> None:
    pool = make_pool()
    pool.alloc(2)
    pool.clear()
    assert pool.available_size() == pool.state_pool.available_size() == 3
    pool.check_state_invariant(0)


def test_rows_for_budget_keep_half_the_budget_for_the_kv_pool() -> None:
    per_row = SHAPE.bytes_per_row()
    assert per_row == 2 * (6 * 3 * 4 + 2 * 3 * 5 * 4)
    assert state_rows_for_budget(SHAPE, 20 * per_row, max_rows=100) == 9  # 10 rows' worth, one the padding row
    assert state_rows_for_budget(SHAPE, 20 * per_row, max_rows=4) == 4
    with pytest.raises(ValueError, match="not enough memory for the linear-attention state of one request"):
        state_rows_for_budget(SHAPE, 3 * per_row, max_rows=4)


def test_a_state_pool_smaller_than_the_request_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="the state pool has 2 rows for 3 request rows"):
        HybridReqToTokenPool(3, 16, "cpu", StatePool(2, SHAPE, "cpu"))
