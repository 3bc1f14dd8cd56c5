"""A step's device-side input fixups (kernels/step_inputs.py) against the torch form they replace
(ScheduleBatch._forward_batch without them), under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.step_inputs import apply_step_inputs, step_kernels_enabled, warm_step_kernels


def packed_step(gen: torch.Generator, bs: int, n_writes: int, table_shape: tuple[int, int]):
    """A packed step buffer as _forward_batch lays it out: input ids, positions, request rows, lengths,
    slots ([bs] each), the in-flight index ([bs], -1 where the host knows the token), then the request
    table's rows, columns and values ([n_writes] each)."""
    rows, cols = table_shape
    ids = torch.randint(0, 5000, (bs,), generator=gen)
    others = torch.randint(0, 100, (4 * bs,), generator=gen)
    index = torch.randint(0, 300, (bs,), generator=gen)
    index[1::3] = -1
    write_rows = torch.randint(0, rows, (n_writes,), generator=gen)
    # Distinct (row, column) pairs: the entries a step sets never repeat.
    write_cols = torch.randperm(cols, generator=gen)[:n_writes]
    values = torch.randint(0, 2**31 - 1, (n_writes,), generator=gen)
    return torch.cat([ids, others, index, write_rows, write_cols, values])


@pytest.mark.parametrize("bs", [1, 7, 300])
def test_step_inputs_are_the_torch_forms(bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    tokens = torch.randint(0, 151936, (300,), generator=gen)
    n_writes = bs
    packed = packed_step(gen, bs, n_writes, (16, 512))
    table = torch.randint(0, 10, (16, 512), generator=gen, dtype=torch.int32)

    want_packed, want_table = packed.clone(), table.clone()
    ids, index = want_packed[:bs], want_packed[5 * bs : 6 * bs]
    torch.where(index >= 0, tokens[index.clamp(min=0)], ids, out=ids)
    r, c, v = want_packed[6 * bs :].split(n_writes)
    want_table[r, c] = v.to(torch.int32)

    apply_step_inputs(packed, tokens, 5 * bs, bs, table, 6 * bs, n_writes)
    assert torch.equal(packed, want_packed) and torch.equal(table, want_table)


def test_step_inputs_without_tokens_in_flight_write_only_the_table() -> None:
    gen = torch.Generator().manual_seed(0)
    packed = packed_step(gen, 4, 9, (3, 64))[: 5 * 4]  # no index part
    writes = torch.tensor([0, 2, 2, 5, 6, 63, 11, 12, 13])
    packed = torch.cat([packed, writes])
    table = torch.zeros((3, 64), dtype=torch.int32)
    before = packed.clone()
    apply_step_inputs(packed, None, -1, 4, table, 20, 3)
    assert torch.equal(packed, before)
    assert table[0, 5] == 11 and table[2, 6] == 12 and table[2, 63] == 13 and table.count_nonzero() == 3


def test_step_inputs_reject_other_layouts() -> None:
    table = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="packed"):
        apply_step_inputs(torch.zeros(4, dtype=torch.int32), None, -1, 1, table, 0, 0)
    with pytest.raises(ValueError, match="req_to_token"):
        apply_step_inputs(torch.zeros(4, dtype=torch.int64), None, -1, 1, table.long(), 0, 0)
    with pytest.raises(ValueError, match="tokens"):
        apply_step_inputs(torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), 2, 1, table, 0, 0)


def test_only_cuda_steps_take_the_kernels(monkeypatch) -> None:
    assert not step_kernels_enabled(torch.device("cpu"))
    monkeypatch.setenv("RS_STEP_KERNELS", "0")
    assert not step_kernels_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("RS_STEP_KERNELS", "1")
    assert step_kernels_enabled(torch.device("cuda", 0))


def test_warming_compiles_both_kernels_and_leaves_the_counters_zero() -> None:
    """A CUDA model load warms the step kernels (the interpreter runs the same calls on the CPU): the
    argmax's shared row counters must come back zero, or the first request's argmax would merge early."""
    import kernels.sampling

    warm_step_kernels(torch.device("cpu"), 3000)
    assert not kernels.sampling._greedy_counters[torch.device("cpu")].any()
