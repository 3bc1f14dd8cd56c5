"""The FP8 one-row GEMV's fused prologues (kernels/fp8_gemv.py fp8_rmsnorm_gemv and fp8_silu_mul_gemv)
against the unfused path they replace, under the Triton interpreter: the norm (kernels/rmsnorm.py) or
the activation (kernels/activation.py) first, then the product with the dequantized weight in float32.
Shapes whose N and K are not multiples of the tiles nor of the scale blocks; float32 and bfloat16 rows."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.fp8_gemv import fp8_block_gemv, fp8_rmsnorm_gemv, fp8_silu_mul_gemv
from kernels.fp8_reference import dequantize_block_weight, quantize_block_weight
from kernels.gemv import GemvTiles
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from tests.kernels.conftest import rel_error

EPS = 1e-6
# float32 rows: only the order of the float32 sums differs; bfloat16: the output's own rounding.
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}

CASES = [
    (45, 88, (16, 32), GemvTiles(8, 32)),  # ragged N and K, a tile narrower than a scale block
    (45, 96, (16, 32), GemvTiles(16, 64)),  # K a multiple of the scale block, not of the tile
    (48, 128, (16, 32), GemvTiles(16, 32)),  # K a multiple of the tile: the unmasked loads
    (37, 200, (128, 128), None),  # the default tiles (fp8_gemv_tiles_for), partial edge blocks
]


def _weight(
    gen: torch.Generator, n: int, k: int, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized blockwise, block magnitudes spread over 1e-2..1e0 (a wrong scale shows)."""
    w = torch.randn((n, k), generator=gen) / k**0.5
    rows, cols = -(-n // block[0]), -(-k // block[1])
    spread = 10.0 ** torch.empty((rows, cols)).uniform_(-2, 0, generator=gen)
    return quantize_block_weight(w * spread.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k],
                                 block)  # fmt: skip


@pytest.mark.parametrize(("n", "k", "block", "tiles"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fp8_rmsnorm_gemv_is_the_norm_then_the_dequantized_product(gen, n, k, block, tiles, dtype, with_residual) -> None:  # fmt: skip
    w_q, w_s = _weight(gen, n, k, block)
    x = (torch.randn((1, k), generator=gen) * 3).to(dtype)
    residual = torch.randn((1, k), generator=gen).to(dtype) if with_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    x_before = x.clone()
    y, res_out = fp8_rmsnorm_gemv(x, residual, norm_w, EPS, w_q, w_s, block, tiles=tiles)
    if with_residual:
        normed, want_res = fused_add_rmsnorm(x, residual, norm_w, EPS)
        # Written back rounded as the unfused norm rounds it, and to a buffer of its own.
        assert torch.equal(res_out, want_res)
        # (The unrounded sum is exact only in float32: bfloat16 holds it rounded.)
        total = x.float() + residual.float()
        assert torch.equal(res_out, total) if dtype == torch.float32 else rel_error(res_out, total) < 1e-2
        assert res_out.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    else:
        normed = rmsnorm(x, norm_w, EPS)
        assert res_out is x
    assert torch.equal(x, x_before)
    want = normed.float() @ dequantize_block_weight(w_q, w_s, block).t()
    assert y.shape == (1, n) and y.dtype == dtype
    assert rel_error(y.float(), want) < TOL[dtype]
    # Against the unfused kernels (the norm, then the FP8 GEMV on its rounded output) with the same tiles:
    # the same products, so only the norm's statistics may differ in the last bit.
    unfused = fp8_block_gemv(normed, w_q, w_s, block, tiles=tiles)
    assert rel_error(y.float(), unfused.float()) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize(("n", "k", "block", "tiles"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_silu_mul_gemv_is_the_activation_then_the_dequantized_product(
    gen, n, k, block, tiles, dtype
) -> None:
    w_q, w_s = _weight(gen, n, k, block)
    gate_up = (torch.randn((1, 2 * k), generator=gen) * 2).to(dtype)
    y = fp8_silu_mul_gemv(gate_up, w_q, w_s, block, tiles=tiles)
    act = silu_and_mul(gate_up)
    want = act.float() @ dequantize_block_weight(w_q, w_s, block).t()
    assert y.shape == (1, n) and y.dtype == dtype
    assert rel_error(y.float(), want) < TOL[dtype]
    # The activation's rounding is the unfused kernel's: the same product of the same rounded row.
    unfused = fp8_block_gemv(act, w_q, w_s, block, tiles=tiles)
    assert rel_error(y.float(), unfused.float()) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_a_wrong_gate_up_half_or_norm_weight_shows(gen) -> None:
    # The prologues must read [gate | up] in that order and the norm's weight per column: swapping the
    # halves or reversing the weight changes the result well beyond the tolerance above.
    n, k, block = 40, 72, (16, 32)
    w_q, w_s = _weight(gen, n, k, block)
    gate_up = torch.randn((1, 2 * k), generator=gen)
    swapped = torch.cat([gate_up[:, k:], gate_up[:, :k]], dim=1)
    assert (
        rel_error(fp8_silu_mul_gemv(gate_up, w_q, w_s, block), fp8_silu_mul_gemv(swapped, w_q, w_s, block))
        > 0.1
    )
    x, norm_w = torch.randn((1, k), generator=gen), 1 + torch.rand(k, generator=gen)
    y, _ = fp8_rmsnorm_gemv(x, None, norm_w, EPS, w_q, w_s, block)
    y_flipped, _ = fp8_rmsnorm_gemv(x, None, norm_w.flip(0), EPS, w_q, w_s, block)
    assert rel_error(y, y_flipped) > 0.05


def test_the_fp8_prologues_refuse_what_they_cannot_fuse(gen) -> None:
    block = (16, 32)
    w_q, w_s = _weight(gen, 8, 64, block)
    norm_w = torch.ones(64)
    with pytest.raises(ValueError, match="one contiguous row of 64"):
        fp8_rmsnorm_gemv(torch.randn((2, 64), generator=gen), None, norm_w, EPS, w_q, w_s, block)
    with pytest.raises(ValueError, match="one contiguous row of 64"):
        fp8_rmsnorm_gemv(torch.randn((64, 2), generator=gen).t()[:1], None, norm_w, EPS, w_q, w_s, block)
    with pytest.raises(ValueError, match="norm_weight must be"):
        fp8_rmsnorm_gemv(torch.randn((1, 64), generator=gen), None, torch.ones(63), EPS, w_q, w_s, block)
    with pytest.raises(ValueError, match="residual shape"):
        fp8_rmsnorm_gemv(
            torch.randn((1, 64), generator=gen), torch.randn((1, 32)), norm_w, EPS, w_q, w_s, block
        )
    with pytest.raises(ValueError, match="'rows' tiles"):
        fp8_rmsnorm_gemv(torch.randn((1, 64), generator=gen), None, norm_w, EPS, w_q, w_s, block,
                         tiles=GemvTiles(kind="dot"))  # fmt: skip
    with pytest.raises(ValueError, match="bfloat16/float16/float32"):
        fp8_rmsnorm_gemv(torch.randn((1, 64), generator=gen).double(), None, norm_w, EPS, w_q, w_s, block)
    with pytest.raises(ValueError, match="w_scale_inv must be float32"):
        fp8_rmsnorm_gemv(torch.randn((1, 64), generator=gen), None, norm_w, EPS, w_q, w_s[:, :1], block)
    with pytest.raises(ValueError, match="one contiguous row of 128"):
        fp8_silu_mul_gemv(torch.randn((1, 64), generator=gen), w_q, w_s, block)


# -- the FP8 layers' dispatch --------------------------------------------------------------------------
# Fp8LinearMethod.kernels is where its products run: the Triton kernels (True), the torch reference
# (False), or by the tensor's device (None, the default: the kernels on CUDA). Here True runs the same
# kernels the GPU runs, under the interpreter, on CPU tensors.


def _fp8_mlp(gen: torch.Generator, hidden: int, inter: int, block: tuple[int, int]):
    from services.worker.runtime.layers.fp8_weights import quantize_fp8_after_load
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.models.llama import LlamaMLP

    mlp = LlamaMLP(hidden, inter, "silu")
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn((2 * inter, hidden), generator=gen) / hidden**0.5)
        mlp.down_proj.weight.copy_(torch.randn((hidden, inter), generator=gen) / inter**0.5)
    assert quantize_fp8_after_load(mlp, block) == ["gate_up_proj", "down_proj"]
    norm = RMSNorm(hidden, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(hidden, generator=gen))
    return mlp, norm


def _run_kernels(mlp, kernels: bool | None) -> None:
    from dataclasses import replace

    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.quant_method = replace(layer.quant_method, kernels=kernels)


def test_an_fp8_mlp_takes_one_row_through_the_fused_kernels(gen) -> None:
    block = (32, 32)
    mlp, norm = _fp8_mlp(gen, 80, 72, block)  # neither a multiple of the 32-wide blocks
    calls = {"norm": 0, "act": 0}
    norm.register_forward_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))
    mlp.act_fn.register_forward_hook(lambda *_: calls.__setitem__("act", calls["act"] + 1))
    for rows in (1, 3):
        x, residual = torch.randn((rows, 80), generator=gen), torch.randn((rows, 80), generator=gen)
        _run_kernels(mlp, False)  # the reference: the torch norm and activation, dequantized products
        want, want_res = mlp.forward_normed(norm, x, residual)
        assert calls == {"norm": 1, "act": 1}
        _run_kernels(mlp, True)
        got, got_res = mlp.forward_normed(norm, x, residual)
        # One row: both elementwise steps inside the FP8 GEMVs, the module's norm and activation never
        # called. Three rows: the separate norm and activation, then the FP8 kernels' products.
        assert calls == ({"norm": 1, "act": 1} if rows == 1 else {"norm": 2, "act": 2})
        assert torch.equal(got_res, want_res)
        assert rel_error(got, want) < 1e-5
        calls.update(norm=0, act=0)
    # The default on CPU tensors is the reference path, norm and activation included.
    _run_kernels(mlp, None)
    one = torch.randn((1, 80), generator=gen)
    assert not mlp.down_proj.quant_method.fuses_prologue(one)
    mlp.forward_normed(norm, one, torch.zeros_like(one))
    assert calls == {"norm": 1, "act": 1}


def test_fp8_dispatch_takes_one_contiguous_row_where_the_kernels_run() -> None:
    from services.worker.runtime.layers.fp8 import Fp8LinearMethod

    on, off, default = (
        Fp8LinearMethod((128, 128), True),
        Fp8LinearMethod((128, 128), False),
        Fp8LinearMethod((128, 128)),
    )
    row = torch.zeros((1, 64))
    assert on.fuses_prologue(row) and not off.fuses_prologue(row) and not default.fuses_prologue(row)
    assert not on.fuses_prologue(torch.zeros((2, 64)))  # a few rows: the norm kernel, then the product
    assert not on.fuses_prologue(torch.zeros((16, 64)))
    # Past the GEMVs' 16 rows, the norm or activation quantizes the rows for the w8a8 GEMM as it writes.
    assert on.fuses_prologue(torch.zeros((17, 64))) and not off.fuses_prologue(torch.zeros((17, 64)))
    assert not on.fuses_prologue(torch.zeros((64, 17)).t())  # strided rows
    assert not on.fuses_prologue(torch.zeros((64, 2)).t()[:1])  # a strided row
    assert not on.fuses_prologue(torch.zeros(64))


@pytest.mark.parametrize(("hidden", "inter", "fused"), [(96, 64, True), (80, 72, False)])
def test_an_fp8_mlp_quantizes_many_rows_inside_its_norm_and_activation(gen, monkeypatch, hidden, inter, fused) -> None:  # fmt: skip
    # 20 rows (batched decode): where the rows are whole 32-column groups, the norm and the activation each
    # quantize their output for the w8a8 GEMM in the same launch (kernels/fp8_quant.py); else the norm's
    # and the activation's own kernels, then the products. Either way the module's torch norm and
    # activation are not called, and the result is the reference path's (torch ops, dequantized products)
    # up to the rows' e4m3 rounding.
    import kernels.fp8_quant as fp8_quant

    block = (32, 32)
    mlp, norm = _fp8_mlp(gen, hidden, inter, block)
    calls = {"norm": 0, "act": 0, "fused": 0}
    norm.register_forward_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))
    mlp.act_fn.register_forward_hook(lambda *_: calls.__setitem__("act", calls["act"] + 1))
    for name in ("rmsnorm_group_quant_fp8", "silu_mul_group_quant_fp8"):
        fn = getattr(fp8_quant, name)
        monkeypatch.setattr(
            fp8_quant,
            name,
            lambda *a, fn=fn, **kw: (calls.__setitem__("fused", calls["fused"] + 1), fn(*a, **kw))[1],
        )
    x, residual = torch.randn((20, hidden), generator=gen), torch.randn((20, hidden), generator=gen)
    _run_kernels(mlp, False)
    want, want_res = mlp.forward_normed(norm, x, residual)
    calls.update(norm=0, act=0)
    _run_kernels(mlp, True)
    got, got_res = mlp.forward_normed(norm, x, residual)
    assert calls == {"norm": 0, "act": 0, "fused": 2 if fused else 0}
    assert torch.equal(got_res, want_res)
    assert rel_error(got, want) < 0.06  # measured 0.035-0.040: e4m3 rows; a wrong scale is far off


# (few_rows, bound against the reference): the weight-only kernels leave the rows unrounded, so only float32
# summation order separates them from the reference; the tensor-core form rounds each row to e4m3 per
# 128-column group (a few percent on these logits; a wrong scale is off by orders of magnitude).
@pytest.mark.parametrize(("few_rows", "bound"), [("weight-only", 1e-5), ("mma", 0.1)])
def test_fp8_batch_one_decode_with_fused_prologues_matches_the_reference(qwen3_path, monkeypatch, few_rows, bound) -> None:  # fmt: skip
    # A whole FP8 model (--quantization fp8) decoding one row with its products on the kernels: each decoder
    # layer's two norms run inside qkv_proj and gate_up_proj, SiLU-and-mul inside down_proj, and the logits
    # and KV match the reference path (torch norms, dequantized float32 products).
    import kernels.fp8_gemv as fp8_gemv_mod
    import kernels.fp8_gemv_mma as fp8_mma_mod
    from services.worker.runtime.layers.fp8 import Fp8LinearMethod
    from services.worker.runtime.model_config import ModelConfig
    from services.worker.runtime.model_loader import load_model
    from tests.forward_helpers import BatchDriver

    config = ModelConfig.from_path(qwen3_path, dtype="float32", quantization="fp8")
    model = load_model(config, "cpu")
    calls = {"norm": 0, "silu": 0}

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    # Fused calls by either kernel module; "mma": those on the tensor cores (layers whose K is a multiple of
    # 128 with few_rows "mma": down_proj here; the others go weight-only).
    calls["mma"] = 0
    for mod, prefix in ((fp8_gemv_mod, "fp8_"), (fp8_mma_mod, "fp8_mma_")):
        for name, key in (("rmsnorm_gemv", "norm"), ("silu_mul_gemv", "silu")):
            fn = count(key, getattr(mod, prefix + name))
            monkeypatch.setattr(mod, prefix + name, count("mma", fn) if mod is fp8_mma_mod else fn)
    fp8_layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]
    assert len(fp8_layers) == 4 * config.num_layers

    def set_kernels(kernels: bool) -> None:
        for m in fp8_layers:
            m.quant_method = Fp8LinearMethod(m.quant_method.block_size, kernels, few_rows)

    drivers = {k: BatchDriver(model, config, max_requests=1, max_tokens=64) for k in (True, False)}
    rows = {k: d.new_request() for k, d in drivers.items()}
    for k, d in drivers.items():
        set_kernels(k)
        d.extend([(rows[k], [5, 9, 14, 3, 7])])
    assert calls == {"norm": 0, "silu": 0, "mma": 0}  # five rows: no fused form
    for token in (11, 4):
        logits = {}
        for k, d in drivers.items():
            set_kernels(k)
            logits[k] = d.decode([(rows[k], token)])
        assert rel_error(logits[True], logits[False]) < bound
    assert calls["norm"] == 2 * 2 * config.num_layers and calls["silu"] == 2 * config.num_layers
    assert calls["mma"] == (0 if few_rows == "weight-only" else 2 * config.num_layers)
    for buffers in ("k_buffer", "v_buffer"):
        for layer_id in range(config.num_layers):
            assert rel_error(getattr(drivers[True].kv_pool, buffers)[layer_id],
                             getattr(drivers[False].kv_pool, buffers)[layer_id]) < bound  # fmt: skip
