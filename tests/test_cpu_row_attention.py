"""Decode attention on the CPU (kernels/cpu/matvec.cpp's decode_attention_row for one request over a span
of the pool, decode_attention_rows for a batch read through each request's slots) against a float64
reference, on every instruction-set path, and through the torch backend against SDPA.

The op is one query row's attention over a span of the pool: each query head's scores, softmax (its
exponential a degree-6 polynomial on AVX-512, libm's expf elsewhere) and weighted values, in float32.
Held to 2e-6 of the output's scale against float64. Bad operands are RuntimeErrors naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_matvec
from tests.test_cpu_matvec import isa, needs_matvec  # noqa: F401 (the fixture)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [kv_heads, group, D], k/v [L, kv_heads, D] -> [kv_heads * group * D], in float64."""
    q64, k64, v64 = q.double(), k.double().permute(1, 0, 2), v.double().permute(1, 0, 2)
    weights = torch.softmax(q64 @ k64.transpose(1, 2) * scale, dim=-1)  # [kv_heads, group, L]
    return (weights @ v64).reshape(-1)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 1, 16), (1, 4, 40)])
def test_row_attention_matches_float64(isa, length, kv_heads, group, head_dim) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(length * 7 + head_dim)
    # A span of a bigger pool: rows are strided by the pool's slot stride, not packed.
    pool_k = torch.randn(length + 9, kv_heads, head_dim, generator=g) * 2
    pool_v = torch.randn(length + 9, kv_heads, head_dim, generator=g)
    k, v = pool_k[4 : 4 + length], pool_v[4 : 4 + length]
    q = torch.randn(kv_heads, group, head_dim, generator=g)
    out = torch.ops.radixserve_cpu.decode_attention_row(q, k, v, head_dim**-0.5)
    ref = _reference(q, k, v, head_dim**-0.5)
    assert out.shape == (kv_heads * group * head_dim,)
    assert (out.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


def test_large_scores_neither_overflow_nor_underflow(isa) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 32, generator=g) * 40
    k, v = torch.randn(50, 1, 32, generator=g) * 40, torch.randn(50, 1, 32, generator=g)
    out = torch.ops.radixserve_cpu.decode_attention_row(q, k, v, 1.0)
    ref = _reference(q, k, v, 1.0)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@needs_matvec
@pytest.mark.parametrize(
    ("q", "k", "match"),
    [
        (torch.zeros(2, 1, 16, dtype=torch.float64), torch.zeros(4, 2, 16), "all float32 or all bfloat16"),
        (torch.zeros(2, 1, 16).bfloat16(), torch.zeros(4, 2, 16), "all float32 or all bfloat16"),
        (torch.zeros(2, 1, 16), torch.zeros(4, 3, 16), "does not match"),
        (torch.zeros(2, 16), torch.zeros(4, 2, 16), r"q must be \[kv_heads, group, D\]"),
        (torch.zeros(2, 1, 16), torch.zeros(4, 2, 32)[:, :, :16], "contiguous"),
        (torch.zeros(2, 1, 16), torch.zeros(0, 2, 16), r"L >= 1"),
    ],
    ids=["dtype", "mixed", "heads", "q-dims", "rows", "empty"],
)
def test_bad_operands_are_clear_errors(q, k, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        torch.ops.radixserve_cpu.decode_attention_row(q, k, torch.zeros_like(k), 0.25)


@pytest.mark.parametrize("layout", ["contiguous", "rows of the projection", "heads strided"])
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 1, 16), (1, 4, 40), (2, 4, 128), (1, 3, 128), (2, 5, 48)]
)
def test_batch_rows_through_their_slots_match_float64(isa, kv_heads, group, head_dim, layout) -> None:  # noqa: F811
    """Requests of 1 to 70 positions whose slots are scattered over the pool (past each length the slot
    table holds slot 0, which must not be read: it is poisoned). q as given, as the q columns of the
    projection's output rows (read in place), or with its heads strided (copied first). Head sizes of 16 to
    128 values (AVX-512's 16-lane loop where D is a multiple of 16; D = 40 the portable loop), groups of 1
    to 5."""
    g = torch.Generator().manual_seed(head_dim + group)
    pool_k = torch.randn(300, kv_heads, head_dim, generator=g) * 2
    pool_v = torch.randn(300, kv_heads, head_dim, generator=g)
    pool_k[0], pool_v[0] = float("nan"), float("nan")
    lens = torch.tensor([1, 70, 16, 17, 33])
    slots = torch.zeros(5, 80, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = torch.randperm(299, generator=g)[:n] + 1
    q = torch.randn(5, kv_heads, group, head_dim, generator=g)
    if layout == "rows of the projection":
        qkv = torch.randn(5, (kv_heads * group + 2 * kv_heads) * head_dim, generator=g)
        qkv[:, : q[0].numel()] = q.flatten(1)
        q = qkv[:, : q[0].numel()].reshape(q.shape)
        assert not q.is_contiguous()
    elif layout == "heads strided":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.ops.radixserve_cpu.decode_attention_rows(q, pool_k, pool_v, slots, lens, head_dim**-0.5)
    assert out.shape == (5, kv_heads * group * head_dim)
    for b, n in enumerate(lens.tolist()):
        ref = _reference(q[b], pool_k[slots[b, :n]], pool_v[slots[b, :n]], head_dim**-0.5)
        assert (out[b].double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 1, 16), (2, 4, 128), (2, 5, 48)])
def test_a_request_in_a_batch_gets_the_lone_rows_bits(isa, dtype, kv_heads, group, head_dim) -> None:  # noqa: F811
    """The batch op's scores take the single-row op's accumulators and order on every path (and the same
    softmax and weighted sum), so a lone request decodes to the same bits through either: the layer op's
    batch of one and the modules' single-row attention agree."""
    g = torch.Generator().manual_seed(head_dim * 3 + group)
    pool_k = (torch.randn(120, kv_heads, head_dim, generator=g) * 2).to(dtype)
    pool_v = torch.randn(120, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([37, 100, 1])
    slots = torch.zeros(3, 100, dtype=torch.int64)
    for b, n in enumerate(lens.tolist()):
        slots[b, :n] = torch.arange(n) + 10 * b  # contiguous spans, as the single-row op reads them
    q = torch.randn(3, kv_heads, group, head_dim, generator=g).to(dtype)
    batch = torch.ops.radixserve_cpu.decode_attention_rows(q, pool_k, pool_v, slots, lens, head_dim**-0.5)
    for b, n in enumerate(lens.tolist()):
        k, v = pool_k[10 * b : 10 * b + n], pool_v[10 * b : 10 * b + n]
        alone = torch.ops.radixserve_cpu.decode_attention_row(q[b], k, v, head_dim**-0.5)
        assert torch.equal(batch[b], alone)


def test_bfloat16_attention_is_the_float32_steps_on_its_widened_values(isa) -> None:  # noqa: F811
    """A bfloat16 q and pool: widened exactly as read, the float32 op's own arithmetic (bit for bit), the
    output rounded to bfloat16 once; one row over a span and a batch through its slots."""
    g = torch.Generator().manual_seed(5)
    pool_k = (torch.randn(120, 3, 64, generator=g) * 2).bfloat16()
    pool_v = torch.randn(120, 3, 64, generator=g).bfloat16()
    q = torch.randn(3, 3, 64, generator=g).bfloat16()
    row = torch.ops.radixserve_cpu.decode_attention_row(q, pool_k[7:60], pool_v[7:60], 0.125)
    wide = torch.ops.radixserve_cpu.decode_attention_row(q.float(), pool_k[7:60].float(), pool_v[7:60].float(), 0.125)
    assert row.dtype == torch.bfloat16 and torch.equal(row, wide.bfloat16())
    lens = torch.tensor([1, 70, 33])
    slots = torch.randint(0, 120, (3, 70), generator=g)
    qs = torch.randn(3, 3, 3, 64, generator=g).bfloat16()
    rows = torch.ops.radixserve_cpu.decode_attention_rows(qs, pool_k, pool_v, slots, lens, 0.125)
    wide = torch.ops.radixserve_cpu.decode_attention_rows(qs.float(), pool_k.float(), pool_v.float(), slots, lens, 0.125)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, wide.bfloat16())
    ref = _reference(q, pool_k[7:60], pool_v[7:60], 0.125)
    assert (row.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


@needs_matvec
@pytest.mark.parametrize(
    ("slots", "lens", "match"),
    [
        (torch.ones(2, 4, dtype=torch.int64), torch.tensor([4, 0]), r"seq_lens\[1\] = 0 is outside \[1, 4\]"),
        (torch.ones(2, 4, dtype=torch.int64), torch.tensor([5, 1]), r"seq_lens\[0\] = 5 is outside \[1, 4\]"),
        (torch.tensor([[1, 2], [3, 9]]), torch.tensor([2, 2]), "slot 9 of request 1 is outside the pool's 8"),
        (torch.ones(2, 4, dtype=torch.int32), torch.tensor([1, 1]), "slots must be int64"),
        (torch.ones(3, 4, dtype=torch.int64), torch.tensor([1, 1]), "slots must be int64"),
    ],
    ids=["empty", "too-long", "slot", "slot-dtype", "rows"],
)
def test_bad_batch_operands_are_clear_errors(slots, lens, match) -> None:
    k = torch.zeros(8, 2, 16)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.radixserve_cpu.decode_attention_rows(torch.zeros(2, 2, 1, 16), k, k, slots, lens, 0.25)


@needs_matvec
def test_a_lone_cpu_decode_uses_it_and_matches_sdpa(llama_path, monkeypatch) -> None:
    """The torch backend's batch-1 float32 decode goes through the op (spied) and gives SDPA's tokens and
    log-probs (within float32 rounding) for 12 greedy steps. The layers run as modules (RS_CPU_LAYER_ROW=0:
    the one-op layer reads the pool through decode_attention_rows, tests/test_cpu_layer_row.py)."""
    from services.worker.frontend.engine import Engine
    from services.worker.runtime.attention import torch_backend

    cpu_matvec.load_matvec()
    calls = []
    real = cpu_matvec.row_attention

    def spy():  # noqa: ANN202
        op = real()
        return lambda *args: calls.append(args[1].shape[0]) or op(*args)

    monkeypatch.setattr(cpu_matvec, "row_attention", spy)
    monkeypatch.setenv("RS_CPU_LAYER_ROW", "0")
    params = {"max_new_tokens": 12, "min_new_tokens": 12, "temperature": 0.0}
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(torch_backend.ROW_ATTENTION_ENV, setting)
        with Engine(str(llama_path), dtype="float32", max_total_tokens=160) as engine:
            out = engine.generate(
                input_ids=[[5, 9, 2, 31, 7, 12]], sampling_params=params, return_logprob=True
            )[0]
        runs[setting] = out
        if setting == "1":
            assert calls and max(calls) >= 6, "batch-1 decode did not reach decode_attention_row"
            calls.clear()
    assert not calls, "RS_CPU_ROW_ATTENTION=0 still used the op"
    assert runs["1"]["output_ids"] == runs["0"]["output_ids"]
    ours = torch.tensor([lp for lp, *_ in runs["1"]["meta_info"]["output_token_logprobs"]])
    ref = torch.tensor([lp for lp, *_ in runs["0"]["meta_info"]["output_token_logprobs"]])
    assert (ours - ref).abs().max() <= 1e-4


@needs_matvec
def test_a_bfloat16_batch_decodes_through_the_op_as_through_sdpa(llama_path, monkeypatch) -> None:
    """A bfloat16 model's decode batch (3 requests) through decode_attention_rows gives SDPA's greedy
    tokens, and log-probs within bfloat16's rounding, for 10 steps."""
    from services.worker.frontend.engine import Engine
    from services.worker.runtime.attention import torch_backend

    cpu_matvec.load_matvec()
    dtypes = []
    real = torch_backend._rows_attention

    def spy(pool):  # noqa: ANN001, ANN202
        op = real(pool)
        if op is not None:  # the backend's decode metadata then reads the batch through the op
            dtypes.append(pool.dtype)
        return op

    monkeypatch.setattr(torch_backend, "_rows_attention", spy)
    params = {"max_new_tokens": 10, "min_new_tokens": 10, "temperature": 0.0}
    prompts = [[5, 9, 2, 31, 7, 12], [3, 3, 8], [40, 2, 19, 6, 6, 1, 9, 30]]
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(torch_backend.ROW_ATTENTION_ENV, setting)
        with Engine(str(llama_path), dtype="bfloat16", max_total_tokens=200) as engine:
            runs[setting] = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert (len(dtypes) > 0) == (setting == "1") and set(dtypes) <= {torch.bfloat16}
        dtypes.clear()
    for ours, ref in zip(runs["1"], runs["0"]):
        assert ours["output_ids"] == ref["output_ids"]
        a = torch.tensor([lp for lp, *_ in ours["meta_info"]["output_token_logprobs"]])
        b = torch.tensor([lp for lp, *_ in ref["meta_info"]["output_token_logprobs"]])
        assert (a - b).abs().max() <= 0.05
