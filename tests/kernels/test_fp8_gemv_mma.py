"""kernels/fp8_gemv_mma.py under the Triton interpreter: decode products of up to 16 rows on the FP8
tensor cores, the rows quantized per 128-column group inside the kernel.

The reference is kernels/fp8_reference.py in float32: the rows quantized by the per-token-group
quantizer the batched GEMM uses, times the dequantized weight. What must hold: the same result with
and without the split over K and with any unroll (only the float32 sums' order differs), the same bits
on a repeat (the split's parts are added in a fixed order, whatever program finishes last) with the
ticket counters back at zero, the fused prologues bit for bit the unfused kernels then the product,
and clear errors for what the kernel cannot take."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.fp8_gemm import fp8_block_linear
from kernels.fp8_gemv import fp8_block_gemv
from kernels.fp8_gemv_mma import (
    MmaGemvTiles,
    fp8_mma_gemv,
    fp8_mma_rmsnorm_gemv,
    fp8_mma_silu_mul_gemv,
    mma_gemv_supported,
    read_ahead,
    split_for,
)
from kernels.fp8_reference import (
    fp8_block_linear_reference,
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
    w8a8_block_fp8_matmul_reference,
)
from kernels.rmsnorm import fused_add_rmsnorm
from kernels.split_reduce import ticket_counters
from tests.kernels.conftest import rel_error

BLOCK = (128, 128)
EPS = 1e-6
# The output's own rounding: float32 rows are summed in float32; bfloat16 outputs carry 8 bits.
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
TILES = [
    MmaGemvTiles(programs=1),  # no split: the output written directly
    MmaGemvTiles(programs=64),  # one group per split: the ticketed reduction
    MmaGemvTiles(block_n=128, programs=8, unroll=2),  # two groups a turn
    MmaGemvTiles(programs=8, unroll=4),  # a split's last turn overhangs K (masked groups)
    MmaGemvTiles(programs=64, prequant=True),  # the rows quantized by their own kernel first
]


def _weight(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 with block magnitudes spread over 1e-2..1e0, so a wrong block scale shows."""
    w = torch.randn((n, k), generator=gen) / k**0.5
    spread = 10.0 ** torch.empty((-(-n // 128), k // 128)).uniform_(-2, 0, generator=gen)
    return quantize_block_weight(w * spread.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1), BLOCK)


def _w8a8(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    a_q, a_s = per_token_group_quant_fp8_reference(x, 128)
    return w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, BLOCK)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 640), (3, 130, 384), (16, 64, 896)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mma_gemv_is_the_group_quantized_product(gen, tiles, m, n, k, dtype) -> None:
    w_q, w_s = _weight(gen, n, k)
    # Rows of very different magnitudes: each is quantized with its own group scales.
    x = (torch.randn((m, k), generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    y = fp8_mma_gemv(x, w_q, w_s, BLOCK, tiles)
    assert y.shape == (m, n) and y.dtype == dtype
    want = _w8a8(x, w_q, w_s)
    assert rel_error(y.float(), want) < TOL[dtype]
    # e4m3's rounding of the rows is what separates it from the weight-only product: a few percent.
    assert rel_error(y.float(), fp8_block_linear_reference(x.float(), w_q, w_s, BLOCK)) < 0.06
    assert torch.equal(ticket_counters(x.device), torch.zeros_like(ticket_counters(x.device)))


def test_a_split_launch_repeats_bit_for_bit(gen) -> None:
    w_q, w_s = _weight(gen, 192, 1024)
    x = torch.randn((2, 1024), generator=gen)
    tiles = MmaGemvTiles(programs=24)
    assert split_for(192, 1024, tiles)[0] == 8
    first = fp8_mma_gemv(x, w_q, w_s, BLOCK, tiles)
    assert all(torch.equal(first, fp8_mma_gemv(x, w_q, w_s, BLOCK, tiles)) for _ in range(2))


def test_split_for_covers_k_in_whole_turns() -> None:
    for n, k, tiles in [(4096, 4096, MmaGemvTiles()), (24576, 4096, MmaGemvTiles(128, 264, unroll=2)),
                        (1024, 3072, MmaGemvTiles(programs=528, unroll=4)), (64, 128, MmaGemvTiles())]:  # fmt: skip
        splits, per_split = split_for(n, k, tiles)
        assert per_split % (128 * tiles.unroll) == 0
        assert (splits - 1) * per_split < k <= splits * per_split  # every split has work, all of K is covered


def test_read_ahead_only_under_pdl_and_by_prologue(monkeypatch) -> None:
    tiles = MmaGemvTiles()
    assert read_ahead(False, 0, False, tiles) == (False, False)
    # Plain and SiLU rows wait inside the loop; an RMSNorm row reads its first tile into registers.
    assert [read_ahead(True, p, False, tiles) for p in (0, 1, 2)] == [
        (True, False),
        (False, True),
        (True, False),
    ]
    assert read_ahead(True, 0, True, tiles) == (False, False)  # rows quantized by a kernel of their own
    assert read_ahead(True, 0, False, MmaGemvTiles(unroll=2)) == (False, False)
    monkeypatch.setenv("RS_PDL_PRELOAD", "0")
    assert read_ahead(True, 1, False, tiles) == (False, False)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("tiles", [TILES[0], TILES[1]])
def test_reading_ahead_changes_no_bit(gen, monkeypatch, tiles, m) -> None:
    # Under PDL the first weight tile is read before the wait (read_ahead); the sums are the same, in the
    # same order. The interpreter has no PDL, so the forms are forced here (the wait is then a no-op).
    import kernels.fp8_gemv_mma as mma

    k = 640
    w_q, w_s = _weight(gen, 256, k)
    x = (torch.randn((m, k), generator=gen) * 3).bfloat16()
    residual, norm_w = (
        torch.randn((1, k), generator=gen).bfloat16(),
        (1 + 0.2 * torch.randn(k, generator=gen)).bfloat16(),
    )
    gate_up = (torch.randn((1, 2 * k), generator=gen) * 2).bfloat16()

    def run() -> list[torch.Tensor]:
        outs = [
            fp8_mma_gemv(x, w_q, w_s, BLOCK, tiles),
            fp8_mma_silu_mul_gemv(gate_up, w_q, w_s, BLOCK, tiles),
        ]
        return outs + list(fp8_mma_rmsnorm_gemv(x[:1], residual, norm_w, EPS, w_q, w_s, BLOCK, tiles))

    plain = run()
    monkeypatch.setattr(
        mma, "read_ahead", lambda pdl, prologue, prequant, t: (prologue in (0, 2), prologue == 1)
    )
    assert all(torch.equal(a, b) for a, b in zip(run(), plain, strict=True))


@pytest.mark.parametrize("tiles", [TILES[0], TILES[3]])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_rmsnorm_prologue_is_the_norm_then_the_product(gen, tiles, with_residual) -> None:
    k = 640
    w_q, w_s = _weight(gen, 200, k)
    x = (torch.randn((1, k), generator=gen) * 3).bfloat16()
    residual = torch.randn((1, k), generator=gen).bfloat16() if with_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).bfloat16()
    y, res_out = fp8_mma_rmsnorm_gemv(x, residual, norm_w, EPS, w_q, w_s, BLOCK, tiles)
    if with_residual:
        normed, want_res = fused_add_rmsnorm(x, residual, norm_w, EPS)
        assert torch.equal(res_out, want_res)
    else:
        from kernels.rmsnorm import rmsnorm

        normed = rmsnorm(x, norm_w, EPS)
        assert res_out is x
    assert torch.equal(y, fp8_mma_gemv(normed, w_q, w_s, BLOCK, tiles))


@pytest.mark.parametrize("tiles", [TILES[1], TILES[2]])
def test_the_silu_prologue_is_the_activation_then_the_product(gen, tiles) -> None:
    w_q, w_s = _weight(gen, 256, 384)
    gate_up = (torch.randn((1, 768), generator=gen) * 2).bfloat16()
    y = fp8_mma_silu_mul_gemv(gate_up, w_q, w_s, BLOCK, tiles)
    assert torch.equal(y, fp8_mma_gemv(silu_and_mul(gate_up), w_q, w_s, BLOCK, tiles))
    # [gate | up] in that order: swapped halves give another product.
    swapped = torch.cat([gate_up[:, 384:], gate_up[:, :384]], dim=1)
    assert rel_error(fp8_mma_silu_mul_gemv(swapped, w_q, w_s, BLOCK, tiles).float(), y.float()) > 0.1


def test_fp8_block_linear_takes_few_rows_through_the_chosen_form(gen) -> None:
    w_q, w_s = _weight(gen, 136, 256)
    x = torch.randn((5, 256), generator=gen)
    assert rel_error(fp8_block_linear(x, w_q, w_s, BLOCK), _w8a8(x, w_q, w_s)) < 1e-5
    weight_only = fp8_block_linear(x, w_q, w_s, BLOCK, few_rows="weight-only")
    assert torch.equal(weight_only, fp8_block_gemv(x, w_q, w_s, BLOCK))
    # Blocks the kernel cannot take (64-column scale blocks) go weight-only whatever is asked.
    w64, s64 = quantize_block_weight(torch.randn((136, 256), generator=gen) / 16, (128, 64))
    assert not mma_gemv_supported(136, 256, (128, 64))
    assert torch.equal(fp8_block_linear(x, w64, s64, (128, 64)), fp8_block_gemv(x, w64, s64, (128, 64)))
    with pytest.raises(ValueError, match="few_rows must be one of"):
        fp8_block_linear(x, w_q, w_s, BLOCK, few_rows="int4")


def test_what_the_mma_gemv_refuses(gen) -> None:
    w_q, w_s = _weight(gen, 64, 256)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fp8_mma_gemv(torch.randn((17, 256)), w_q, w_s, BLOCK)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fp8_mma_gemv(torch.randn((0, 256)), w_q, w_s, BLOCK)
    with pytest.raises(ValueError, match=r"bfloat16/float16/float32 \[M, 256\]"):
        fp8_mma_gemv(torch.randn((1, 255)), w_q, w_s, BLOCK)
    with pytest.raises(ValueError, match=r"bfloat16/float16/float32 \[M, 256\]"):
        fp8_mma_gemv(torch.randn((1, 256)).double(), w_q, w_s, BLOCK)
    w_odd, s_odd = quantize_block_weight(torch.randn((64, 200), generator=gen), BLOCK)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        fp8_mma_gemv(torch.randn((1, 200)), w_odd, s_odd, BLOCK)
    with pytest.raises(ValueError, match="one contiguous row of 512"):
        fp8_mma_silu_mul_gemv(torch.randn((1, 256)), w_q, w_s, BLOCK)
    with pytest.raises(ValueError, match="one contiguous row of 256"):
        fp8_mma_rmsnorm_gemv(torch.randn((2, 256)), None, torch.ones(256), EPS, w_q, w_s, BLOCK)
