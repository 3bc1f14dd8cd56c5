"""Block-wise FP8 kernels (kernels/fp8_gemm.py) against their float32 torch references, under the Triton
interpreter: the activation quantizer bit for bit, the w8a8 GEMM and the weight-only GEMV on shapes whose
N and K leave partial edge blocks, and what each refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import (
    FP8_MAX,
    GEMV_MAX_ROWS,
    Fp8Tiles,
    fp8_block_gemv,
    fp8_block_linear,
    fp8_block_linear_reference,
    fp8_tiles_for,
    per_token_group_quant_fp8,
    w8a8_block_fp8_matmul,
)
from kernels.fp8_reference import (
    dequantize_groups,
    fp8_scale,
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
    w8a8_block_fp8_matmul_reference,
)
from kernels.gemv import GemvTiles
from tests.kernels.conftest import rel_error

FP8 = torch.float8_e4m3fn
# Tiles narrower than a 32-wide scale block, and tiles spanning two of them.
NARROW = Fp8Tiles(block_m=16, block_n=16, block_k=32, group_m=2, num_stages=1)
WIDE = Fp8Tiles(block_m=32, block_n=64, block_k=32, group_m=2, num_stages=1)


def _weight(
    gen: torch.Generator, n: int, k: int, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized blockwise, with block magnitudes spread over 1e-3..1e1 (so a wrong scale
    index shows)."""
    w = torch.randn((n, k), generator=gen)
    rows, cols = -(-n // block[0]), -(-k // block[1])
    spread = 10.0 ** torch.empty((rows, cols)).uniform_(-3, 1, generator=gen)
    w = w * spread.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return quantize_block_weight(w, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "group"), [(3, 200, 64), (17, 128, 128), (1, 40, 16), (5, 300, 96)])
def test_group_quant_matches_the_reference_bit_for_bit(gen, dtype, m, k, group) -> None:
    # Magnitudes from 1e-6 to 1e2 within a row: e4m3 subnormals, values that round up into the next
    # binade, and saturation at 448 are all exercised.
    x = (torch.randn((m, k), generator=gen) * 10.0 ** torch.empty((m, k)).uniform_(-6, 2, generator=gen)).to(
        dtype
    )
    q, scale = per_token_group_quant_fp8(x, group)
    q_ref, scale_ref = per_token_group_quant_fp8_reference(x, group)
    assert q.dtype == FP8 and q.shape == (m, k)
    assert scale.dtype == torch.float32 and scale.shape == (m, -(-k // group))
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_scales_are_the_correctly_rounded_quotient_and_ties_go_to_even(gen) -> None:
    # The scale is amax / 448 rounded once (float64's quotient rounded to float32), not amax times a
    # rounded 1/448 (what torch does on CUDA for a Python divisor, one ulp off for most amaxes): the
    # reference and the kernel then agree on the e4m3 ties bfloat16 rows hit. amax 3.0625 gives the scale
    # 0.0068359375 exactly; x = 1.2578125 is 184.0 scales, halfway between e4m3's 176 and 192, and goes to
    # 192 (the even mantissa); x = 0.060302734375 (amax 2.84375) is 9.5 scales and goes to 10.
    amax = torch.rand(4096, generator=gen).bfloat16().float() * 10 + 1e-3
    assert torch.equal(fp8_scale(amax), (amax.double() / FP8_MAX).float())
    x = torch.zeros((2, 64), dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = 3.0625, 1.2578125, -1.2578125
    x[1, 0], x[1, 1] = 2.84375, 0.060302734375
    for q, scale in (per_token_group_quant_fp8(x, 64), per_token_group_quant_fp8_reference(x, 64)):
        assert scale[0, 0].item() == 0.0068359375
        assert q[0, :3].float().tolist() == [448.0, 192.0, -192.0]
        assert q[1, :2].float().tolist() == [448.0, 10.0]


def test_group_quant_round_trip_and_scales(gen) -> None:
    k, group = 100, 32  # a partial last group of 4
    x = torch.randn((4, k), generator=gen) * 5
    x[1, 32:64] = 0.0  # an all-zero group: finite scale, zeros out
    q, scale = per_token_group_quant_fp8(x, group)
    groups = torch.nn.functional.pad(x, (0, 4 * group - k)).view(4, 4, group)
    assert torch.equal(scale, groups.abs().amax(-1).clamp(min=1e-10) / FP8_MAX)
    assert scale[1, 1] > 0 and (q[1, 32:64].float() == 0).all()
    # Each group's largest magnitude lands exactly on 448; every element within e4m3's half-ulp (2^-4
    # relative, or half the smallest subnormal step).
    qf = torch.nn.functional.pad(q.float(), (0, 4 * group - k)).view(4, 4, group)
    nonzero = groups.abs().amax(-1) > 0
    assert torch.equal(qf.abs().amax(-1)[nonzero], torch.full_like(scale[nonzero], FP8_MAX))
    back = dequantize_groups(q, scale, group)
    bound = torch.maximum(x.abs() * 2**-4, scale.repeat_interleave(group, 1)[:, :k] * 2**-10)
    assert ((back - x).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matmul_matches_the_dequantized_product(gen, m, out_dtype) -> None:
    block = (32, 32)
    n, k = 50, 72  # partial edge blocks on both axes
    w_q, w_s = _weight(gen, n, k, block)
    a_q, a_s = per_token_group_quant_fp8_reference(torch.randn((m, k), generator=gen), block[1])
    tiles = NARROW if m < 100 else WIDE
    out = w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, block, out_dtype=out_dtype, tiles=tiles)
    assert out.shape == (m, n) and out.dtype == out_dtype
    ref = w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, block)
    assert rel_error(out.float(), ref) < (1e-6 if out_dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize(("m", "split_k"), [(3, 2), (17, 3), (20, 5), (40, 8)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matmul_split_k_matches_the_dequantized_product(gen, m, split_k, out_dtype) -> None:
    # K = 136 in 32-wide steps is 5 steps (the last partial): 2 splits of 3 + 2 steps, 3 of 2 + 2 + 1,
    # 5 of one, and 8 asked for but 5 made (no empty split). Partials are added in split order.
    block = (32, 32)
    n, k = 50, 136
    w_q, w_s = _weight(gen, n, k, block)
    a_q, a_s = per_token_group_quant_fp8_reference(torch.randn((m, k), generator=gen), block[1])
    tiles = Fp8Tiles(block_m=16, block_n=16, block_k=32, group_m=2, num_stages=1, split_k=split_k)
    out = w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, block, out_dtype=out_dtype, tiles=tiles)
    assert out.shape == (m, n) and out.dtype == out_dtype
    ref = w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, block)
    assert rel_error(out.float(), ref) < (1e-6 if out_dtype == torch.float32 else 4e-3)


def test_w8a8_tiles_by_rows_and_programs() -> None:
    # The Qwen3-8B layer on an H100 (132 SMs): 33-128 rows take 64 x 64 tiles, K split in two where they
    # leave fewer programs than SMs (o and down: 4096 / 64 = 64 columns of tiles, 2 rows of them at 96).
    narrow = Fp8Tiles(block_m=64, block_n=64, num_stages=4)
    assert fp8_tiles_for(96, 4096, 132) == Fp8Tiles(block_m=64, block_n=64, num_stages=4, split_k=2)
    assert fp8_tiles_for(96, 6144, 132) == narrow  # qkv: 192 programs
    assert fp8_tiles_for(128, 24576, 132) == narrow
    # 129-256 rows: 64 x 128 where it leaves two programs per SM (gate_up), else 64 x 64 (qkv, o, down).
    assert fp8_tiles_for(192, 24576, 132) == Fp8Tiles()
    assert fp8_tiles_for(192, 6144, 132) == narrow
    assert fp8_tiles_for(256, 4096, 132) == narrow
    assert fp8_tiles_for(257, 4096, 132) == Fp8Tiles()  # past 256 rows: 64 x 128 (swept at 4,096)
    assert fp8_tiles_for(32, 4096, 132).block_m == 16
    assert fp8_tiles_for(96) == narrow and fp8_tiles_for(200) == Fp8Tiles()  # no weight given


def test_w8a8_matmul_with_default_tiles_and_published_blocks(gen) -> None:
    block = (128, 128)
    n, k, m = 200, 300, 20
    w_q, w_s = _weight(gen, n, k, block)
    a_q, a_s = per_token_group_quant_fp8_reference(torch.randn((m, k), generator=gen), 128)
    out = w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, block, out_dtype=torch.float32)
    assert rel_error(out, w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, block)) < 1e-6


@pytest.mark.parametrize(
    ("m", "tiles", "k"),
    [
        (1, GemvTiles(8, 32), 88),  # rows form, BLOCK_K tile narrower than bk, ragged K
        (1, GemvTiles(16, 64), 88),  # rows form, one tile spanning two k-blocks
        (1, GemvTiles(16, 32), 96),  # rows form, K a multiple of the tile (no masks)
        (1, GemvTiles(16, 32, kind="dot"), 88),  # the dot form takes a single row too
        (3, GemvTiles(16, 32, kind="dot"), 88),
        (3, GemvTiles(16, 32, kind="dot"), 96),
        (16, GemvTiles(8, 16, kind="dot"), 88),  # the most rows; two tiles per k-block
    ],
)
def test_fp8_gemv_matches_the_reference(gen, m, tiles, k) -> None:
    block = (16, 32)
    n = 45
    w_q, w_s = _weight(gen, n, k, block)
    x = torch.randn((m, k), generator=gen)
    out = fp8_block_gemv(x, w_q, w_s, block, tiles=tiles)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_error(out, fp8_block_linear_reference(x, w_q, w_s, block)) < 1e-6


# Both half types through the dot form too (3 rows) since kernels/interpreter_compat.py widens the
# interpreter's bfloat16 dot operands (it multiplied their bit patterns).
@pytest.mark.parametrize(("m", "dtype"), [(1, torch.bfloat16), (3, torch.float16), (3, torch.bfloat16)])
def test_fp8_gemv_default_tiles_half_types(gen, m, dtype) -> None:
    block = (128, 128)
    n, k = 136, 200
    w_q, w_s = _weight(gen, n, k, block)
    x = torch.randn((m, k), generator=gen).to(dtype)
    out = fp8_block_gemv(x, w_q, w_s, block)
    assert out.dtype == dtype
    ref = x.float() @ (w_q.float() * w_s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).t()
    assert rel_error(out.float(), ref) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 17, 130])
def test_fp8_block_linear_matches_the_reference(gen, m) -> None:
    block = (32, 32)
    n, k = 70, 100
    w_q, w_s = _weight(gen, n, k, block)
    x = torch.randn((m, k), generator=gen)
    bias = torch.randn(n, generator=gen)
    out = fp8_block_linear(x, w_q, w_s, block, bias=bias)
    ref = fp8_block_linear_reference(x, w_q, w_s, block, bias=bias)
    assert out.shape == (m, n) and out.dtype == x.dtype
    if m <= GEMV_MAX_ROWS:  # weight-only: the reference's product exactly, up to summation order
        assert rel_error(out, ref) < 1e-6
    else:
        # w8a8: the reference's product on the activations as the quantizer leaves them...
        a_q, a_s = per_token_group_quant_fp8_reference(x, block[1])
        exact = w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, block) + bias
        assert rel_error(out, exact) < 1e-6
        # ...which is e4m3's rounding of the activations away from the unquantized one.
        assert rel_error(out, ref) < 5e-2


def test_fp8_block_linear_keeps_leading_dims_and_empty_batches(gen) -> None:
    block = (32, 32)
    w_q, w_s = _weight(gen, 40, 64, block)
    x = torch.randn((2, 3, 64), generator=gen)
    out = fp8_block_linear(x, w_q, w_s, block)
    assert out.shape == (2, 3, 40)
    assert rel_error(out, fp8_block_linear_reference(x, w_q, w_s, block)) < 1e-6
    assert fp8_block_linear(torch.empty((0, 64)), w_q, w_s, block).shape == (0, 40)


def test_bad_inputs_are_refused(gen) -> None:
    block = (32, 32)
    w_q, w_s = _weight(gen, 40, 64, block)
    a_q, a_s = per_token_group_quant_fp8_reference(torch.randn((20, 64), generator=gen), 32)
    with pytest.raises(ValueError, match="w_q must be a 2-D float8_e4m3fn"):
        fp8_block_linear(torch.randn(2, 64), w_q.float(), w_s, block)
    with pytest.raises(ValueError, match=r"w_scale_inv must be float32 of shape \[2, 2\]"):
        fp8_block_linear(torch.randn(2, 64), w_q, w_s[:1], block)
    with pytest.raises(ValueError, match="w_scale_inv must be float32"):
        fp8_block_linear(torch.randn(2, 64), w_q, w_s.double(), block)
    with pytest.raises(ValueError, match="x must be"):
        fp8_block_linear(torch.randn(2, 63), w_q, w_s, block)
    with pytest.raises(ValueError, match="x must be"):
        fp8_block_linear(torch.randn(2, 64).double(), w_q, w_s, block)
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8_block_linear(torch.randn(2, 64), w_q, w_s, block, bias=torch.zeros(41))
    with pytest.raises(ValueError, match="block_size must be two positive"):
        fp8_block_linear(torch.randn(2, 64), w_q, w_s, (32, 0))
    # Activation groups of 16 where the weight's blocks are 32 wide: the scales cannot line up.
    a16_q, a16_s = per_token_group_quant_fp8_reference(torch.randn((20, 64), generator=gen), 16)
    with pytest.raises(ValueError, match="block_size.1. = 32"):
        w8a8_block_fp8_matmul(a16_q, a16_s, w_q, w_s, block)
    with pytest.raises(ValueError, match="a_q must be float8_e4m3fn"):
        w8a8_block_fp8_matmul(a_q.float(), a_s, w_q, w_s, block)
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, block, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fp8_block_gemv(torch.randn(17, 64), w_q, w_s, block)
    with pytest.raises(ValueError, match="'rows' tiles take one row"):
        fp8_block_gemv(torch.randn(2, 64), w_q, w_s, block, tiles=GemvTiles(8, 32))
    with pytest.raises(ValueError, match="group_size must be a positive"):
        per_token_group_quant_fp8(torch.randn(2, 64), 0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        per_token_group_quant_fp8(torch.randn(2, 64).to(torch.int32), 32)
