"""FP8 fused MoE (kernels/fused_moe.py with block-scaled float8_e4m3fn experts) against the float32
reference (kernels/fp8_reference.fused_moe_fp8_reference), both forms, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_reference import dequantize_block_weight, fused_moe_fp8_reference, quantize_block_weight
from kernels.fused_moe import DETERMINISTIC_MOE_TILES, MoeTiles, fused_moe
from kernels.reference import fused_moe_ref
from tests.kernels.conftest import rel_error
from tests.kernels.test_fused_moe import _routing

SMALL = MoeTiles(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)


def _experts(gen: torch.Generator, experts: int, hidden: int, inter: int, block: tuple[int, int]):
    """Random experts quantized blockwise, block magnitudes spread over two decades (a wrong scale shows)."""

    def spread(shape: tuple[int, int, int]) -> torch.Tensor:
        w = torch.randn(shape, generator=gen) / shape[2] ** 0.5
        rows, cols = -(-shape[1] // block[0]), -(-shape[2] // block[1])
        s = 10.0 ** torch.empty((shape[0], rows, cols)).uniform_(-1, 1, generator=gen)
        s = s.repeat_interleave(block[0], 1)[:, : shape[1]].repeat_interleave(block[1], 2)[..., : shape[2]]
        return w * s

    w13, w13_s = quantize_block_weight(spread((experts, 2 * inter, hidden)), block)
    w2, w2_s = quantize_block_weight(spread((experts, hidden, inter)), block)
    return w13, w2, w13_s, w2_s


@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "block"),
    [
        # H and I off the block grid (partial edge blocks in both GEMMs); the up rows start at row 40,
        # inside w13's second row block, which gate and up share
        (7, 6, 2, 72, 40, (32, 32)),
        (3, 8, 4, 64, 48, (16, 32)),  # bn narrower than bk; gate and up split on a block boundary
        (1, 4, 1, 40, 24, (32, 32)),  # one token; I = 24 shorter than one K block
        # Tiles inside one weight block (BLOCK_N 32 divides bn, N on the grid): one scale per tile and K
        # step, in both GEMMs; then bn = 64 spanning two tiles, the down GEMM's N = 96 off the grid.
        (5, 4, 2, 64, 64, (32, 32)),
        (4, 4, 2, 96, 128, (64, 32)),
    ],
)
def test_fp8_fused_moe_matches_the_reference(
    gen, fp8_activations, tokens, experts, top_k, hidden, inter, block
):
    x = torch.randn((tokens, hidden), generator=gen)
    w13, w2, w13_s, w2_s = _experts(gen, experts, hidden, inter, block)
    weights, ids = _routing(gen, tokens, experts, top_k)
    out = fused_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        SMALL,
        w13_scale_inv=w13_s,
        w2_scale_inv=w2_s,
        block_size=block,
        fp8_activations=fp8_activations,
    )
    assert out.shape == (tokens, hidden) and out.dtype == x.dtype
    ref = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, fp8_activations)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize(
    ("tiles", "dtype"),
    [
        (SMALL, torch.float32),
        (DETERMINISTIC_MOE_TILES, torch.float16),
        (DETERMINISTIC_MOE_TILES, torch.bfloat16),
    ],
)
def test_fp8_one_pair_per_block_matches_the_sorted_layout_bit_for_bit(
    gen, row_dot, fp8_activations, tiles, dtype
) -> None:
    # 7 tokens on 4 experts, top-2 (sorted blocks of several pairs); the deterministic tiles sum in order.
    block, tokens, experts, top_k = (32, 32), 7, 4, 2
    x = torch.randn((tokens, 72), generator=gen).to(dtype)
    w13, w2, w13_s, w2_s = _experts(gen, experts, 72, 40, block)
    weights, ids = _routing(gen, tokens, experts, top_k)
    kw = dict(
        w13_scale_inv=w13_s, w2_scale_inv=w2_s, block_size=block, fp8_activations=fp8_activations,
        sum_in_order=tiles is DETERMINISTIC_MOE_TILES,
    )  # fmt: skip
    fast = fused_moe(x, w13, w2, weights, ids, tiles, pair_per_block=True, **kw)
    assert torch.equal(fast, fused_moe(x, w13, w2, weights, ids, tiles, pair_per_block=False, **kw))
    # x in its own dtype: the reference rounds w8a8's intermediate to it before quantizing, as the kernel
    # does (given x.float() it kept it in float32, and e4m3 made that 4e-3 in bfloat16).
    ref = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, fp8_activations)
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert rel_error(fast.float(), ref) < tolerance
    for t in (0, 6):  # a token alone (one pair per block by default) is its row of the batch
        alone = fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], tiles, **kw)
        assert torch.equal(alone[0], fast[t])


@pytest.mark.parametrize("tokens", [1, 12])
def test_w8a8_bfloat16_moe_rounds_its_intermediate_as_the_reference(gen, row_dot, tokens) -> None:
    # w8a8 stores silu(gate) * up in bfloat16 and quantizes that to e4m3, so a bfloat16 rounded another
    # way than the reference's (to nearest even, as the GPU does) is a 1-ulp change e4m3's rounding can
    # make a whole e4m3 step (6-12 % of the element): the interpreter's truncating cast did, 1.7-2.2 %
    # here. Rounded as the reference rounds, what is left is the outputs' bfloat16 roundings (2.4e-3,
    # as weight-only experts): the pairs' products and their sum. Default tiles, both layouts.
    block, experts, top_k, hidden, inter = (128, 128), 8, 2, 256, 256
    x = torch.randn((tokens, hidden), generator=gen).bfloat16()
    w13, w2, w13_s, w2_s = _experts(gen, experts, hidden, inter, block)
    weights, ids = _routing(gen, tokens, experts, top_k)
    kw = dict(w13_scale_inv=w13_s, w2_scale_inv=w2_s, block_size=block, fp8_activations=True)
    out = fused_moe(x, w13, w2, weights, ids, pair_per_block=True, **kw)
    assert torch.equal(out, fused_moe(x, w13, w2, weights, ids, pair_per_block=False, **kw))
    ref = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, True)
    assert out.dtype == torch.bfloat16
    assert rel_error(out.float(), ref) < 4e-3


def test_weight_only_fp8_moe_is_the_dequantized_moe_and_w8a8_is_close_to_it(gen) -> None:
    # The two references agree with the plain MoE on dequantized weights (weight-only exactly, w8a8 up
    # to e4m3's rounding of the activations), so the FP8 reference is the reference it claims to be.
    block = (32, 32)
    x = torch.randn((9, 64), generator=gen)
    w13, w2, w13_s, w2_s = _experts(gen, 4, 64, 32, block)
    weights, ids = _routing(gen, 9, 4, 2)
    plain = fused_moe_ref(
        x, dequantize_block_weight(w13, w13_s, block), dequantize_block_weight(w2, w2_s, block), weights, ids
    )
    weight_only = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, False)
    assert rel_error(weight_only, plain) < 1e-6
    w8a8 = fused_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        SMALL,
        w13_scale_inv=w13_s,
        w2_scale_inv=w2_s,
        block_size=block,
        fp8_activations=True,
    )
    assert 1e-4 < rel_error(w8a8, plain) < 6e-2


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_moe_default_tiles_and_form_published_blocks(gen, tokens) -> None:
    block = (128, 128)
    experts, top_k = 4, 2
    x = torch.randn((tokens, 160), generator=gen)
    w13, w2, w13_s, w2_s = _experts(gen, experts, 160, 136, block)
    weights, ids = _routing(gen, tokens, experts, top_k)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale_inv=w13_s, w2_scale_inv=w2_s, block_size=block)
    # The default form is w8a8 at every size: the weight-only reference is 1e-2 away, the w8a8 one 1e-7.
    assert rel_error(out, fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, True)) < 1e-5
    assert rel_error(out, fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, False)) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_moe_half_precision(gen, dtype) -> None:
    # bfloat16 weight-only dots run under the interpreter since kernels/interpreter_compat.py widens them.
    block = (32, 32)
    x = torch.randn((6, 64), generator=gen).to(dtype)
    w13, w2, w13_s, w2_s = _experts(gen, 4, 64, 32, block)
    weights, ids = _routing(gen, 6, 4, 2)
    for quantize in (False, True):
        out = fused_moe(
            x,
            w13,
            w2,
            weights,
            ids,
            SMALL,
            w13_scale_inv=w13_s,
            w2_scale_inv=w2_s,
            block_size=block,
            fp8_activations=quantize,
        )
        assert out.dtype == dtype
        ref = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, block, weights, ids, quantize)
        assert rel_error(out.float(), ref) < 5e-3


def test_fp8_moe_rejects_mismatched_scales(gen) -> None:
    block = (32, 32)
    x = torch.randn((2, 64), generator=gen)
    w13, w2, w13_s, w2_s = _experts(gen, 4, 64, 32, block)
    weights, ids = _routing(gen, 2, 4, 2)

    def call(**kw):
        args = dict(w13_scale_inv=w13_s, w2_scale_inv=w2_s, block_size=block) | kw
        return fused_moe(x, args.pop("w13", w13), args.pop("w2", w2), weights, ids, SMALL, **args)

    with pytest.raises(ValueError, match="together"):
        call(w2_scale_inv=None)
    with pytest.raises(ValueError, match=r"w13_scale_inv must be float32 \[4, 2, 2\]"):
        call(w13_scale_inv=w13_s[:, :1])
    with pytest.raises(ValueError, match="w2_scale_inv must be float32"):
        call(w2_scale_inv=w2_s.half())
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn"):
        call(w13=w13.float())
    with pytest.raises(ValueError, match="block_size must be two positive"):
        call(block_size=(32,))
    with pytest.raises(ValueError, match="multiple of 16"):
        call(block_size=(32, 8), w13_scale_inv=torch.ones(4, 2, 8), w2_scale_inv=torch.ones(4, 2, 4))
    with pytest.raises(ValueError, match="need w13_scale_inv"):
        fused_moe(x, w13, w2, weights, ids, SMALL)
    with pytest.raises(ValueError, match="FP8 experts only"):
        fused_moe(x, w13.float(), w2.float(), weights, ids, SMALL, fp8_activations=True)


def test_fused_moe_refuses_batches_past_int32_offsets() -> None:
    tokens = 2**27  # x 16 features = 2^31 elements, never allocated: broadcast views
    x = torch.zeros(1, 16).expand(tokens, 16)
    ids = torch.zeros(1, 2, dtype=torch.long).expand(tokens, 2)
    weights = torch.ones(1, 2).expand(tokens, 2)
    with pytest.raises(ValueError, match="too many for one call"):
        fused_moe(x, torch.zeros(4, 32, 16), torch.zeros(4, 16, 16), weights, ids)
