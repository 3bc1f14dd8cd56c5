"""The batch-1 Triton GEMV against a float32 matrix product, under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvTiles, gemv
from tests.kernels.conftest import poisoned, rel_error


@pytest.mark.parametrize(("n", "k", "tiles"), [
    (48, 64, GemvTiles(16, 32)),      # even K, rows a multiple of the block
    (37, 100, GemvTiles(16, 32)),     # ragged rows and ragged K
    (5, 24, GemvTiles(8, 64)),        # fewer rows than one block, K shorter than one tile
])
def test_gemv_matches_float32_product(gen, n, k, tiles) -> None:
    x = torch.randn((1, k), generator=gen)
    w = torch.randn((n, k), generator=gen)
    out = gemv(x, w, out=poisoned((n,)), tiles=tiles)
    assert out.shape == (1, n)
    assert rel_error(out, x @ w.t()) < 1e-5


@pytest.mark.parametrize("k", [96, 100, 32, 20], ids=["three-tiles", "ragged-fourth", "one-tile", "one-ragged"])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_the_weight_tile_read_before_the_wait_gives_the_same_bits(gen, monkeypatch, k, prologue) -> None:
    """The first weight tile read ahead (the default for a small weight), up to three (RS_PDL_PRELOAD_SLICE)
    or none (RS_PDL_PRELOAD=0): the same sums in the same order, so the same bits, with and without a
    prologue, a ragged last tile among those read ahead included."""
    from kernels.gemv import reads_ahead, rmsnorm_gemv, silu_mul_gemv, tiles_read_ahead

    n = 24
    w = torch.randn((n, k), generator=gen)
    x = torch.randn((1, 2 * k if prologue == "silu_mul" else k), generator=gen)
    res, norm_w = torch.randn((1, k), generator=gen), torch.rand(k, generator=gen) + 0.5

    def run() -> torch.Tensor:
        tiles = GemvTiles(8, 32)
        if prologue == "rmsnorm":
            return rmsnorm_gemv(x, res, norm_w, 1e-6, w, tiles)[0]
        if prologue == "silu_mul":
            return silu_mul_gemv(x, w, tiles)
        return gemv(x, w, tiles=tiles)

    assert reads_ahead(w) and tiles_read_ahead(w, 32) == 1
    ahead = run()
    tiles = -(-k // 32)
    monkeypatch.setenv("RS_PDL_PRELOAD_SLICE", "1")
    assert tiles_read_ahead(w, 32) == min(3, tiles)
    assert torch.equal(run(), ahead)
    for block_k, expected in ((16, 3), (8, 3)):  # more tiles than three: three read ahead
        assert tiles_read_ahead(w, block_k) == min(expected, -(-k // block_k))
    monkeypatch.setenv("RS_PDL_PRELOAD", "0")
    assert not reads_ahead(w) and tiles_read_ahead(w, 32) == 0
    assert torch.equal(run(), ahead)
    ref = {"none": lambda: x @ w.t(), "silu_mul": lambda: (torch.nn.functional.silu(x[:, :k]) * x[:, k:]) @ w.t()}
    if prologue in ref:
        assert rel_error(ahead, ref[prologue]()) < 1e-5


def test_only_weights_up_to_16_mib_read_ahead() -> None:
    from kernels.gemv import reads_ahead

    def w(n: int, k: int) -> torch.Tensor:
        return torch.empty((n, k), dtype=torch.bfloat16, device="meta")

    # Qwen3-0.6B's largest product reads ahead, Qwen3-8B's smallest does not (PRELOAD_MAX_WEIGHT_BYTES).
    assert reads_ahead(w(6144, 1024))
    assert not reads_ahead(w(4096, 4096))


def test_gemv_reads_a_row_slice_of_a_wider_weight(gen) -> None:
    # A weight whose rows are strided (a view of a bigger matrix) is read through its row stride.
    big = torch.randn((20, 80), generator=gen)
    w = big[:, 16:48]
    x = torch.randn(32, generator=gen)
    out = gemv(x, w, tiles=GemvTiles(8, 16))
    assert out.shape == (20,)
    assert rel_error(out, w @ x) < 1e-5


def test_gemv_rejects_what_it_cannot_compute(gen) -> None:
    w = torch.randn((8, 16), generator=gen)
    with pytest.raises(ValueError, match="one row of 16"):
        gemv(torch.randn((2, 16), generator=gen), w)
    with pytest.raises(ValueError, match="one row of 16"):
        gemv(torch.randn((1, 15), generator=gen), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.randn((1, 8), generator=gen), w.t())
    with pytest.raises(ValueError, match="bfloat16"):
        gemv(torch.randn((1, 16), generator=gen).bfloat16(), w)


def test_a_linear_layer_with_gemv_tiles_sends_single_rows_to_the_gemv(gen, monkeypatch) -> None:
    from services.worker.runtime.layers import linear as linear_mod

    layer = linear_mod.ReplicatedLinear(24, 40, bias=True)
    layer.weight.data.copy_(torch.randn((40, 24), generator=gen))
    layer.bias.data.copy_(torch.randn(40, generator=gen))
    calls = []

    def counting_gemv(x, w, out=None, tiles=None):
        calls.append(tiles)
        return gemv(x, w, out=out, tiles=tiles)

    monkeypatch.setattr(linear_mod, "_gemv", counting_gemv)
    layer.gemv_tiles = GemvTiles(8, 16)
    one = torch.randn((1, 24), generator=gen)
    assert rel_error(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias)) < 1e-5
    assert calls == [GemvTiles(8, 16)]
    # Two rows (and a layer without tiles) stay on F.linear, bit for bit.
    two = torch.randn((2, 24), generator=gen)
    assert torch.equal(layer(two), torch.nn.functional.linear(two, layer.weight, layer.bias))
    layer.gemv_tiles = None
    assert torch.equal(layer(one), torch.nn.functional.linear(one, layer.weight, layer.bias))
    assert len(calls) == 1


def test_choose_gemv_tiles_keeps_the_triton_product_only_where_it_wins() -> None:
    from services.worker.runtime.layers.linear_calibration import GEMV_MIN_GAIN, choose_gemv_tiles

    a, b = GemvTiles(8, 512), GemvTiles(16, 1024)
    # Seconds per pass by (shape, tiles); None is cuBLAS.
    table = {
        ((64, 32), None): 10.0, ((64, 32), a): 8.0, ((64, 32), b): 9.0,           # a wins clearly
        ((32, 64), None): 10.0, ((32, 64), a): 11.0, ((32, 64), b): 12.0,         # cuBLAS wins
        ((16, 16), None): 10.0, ((16, 16), a): 10.0 * (1 - GEMV_MIN_GAIN / 2), ((16, 16), b): 11.0,  # too close
    }
    shapes = {shape: [torch.empty(shape)] for shape in [(64, 32), (32, 64), (16, 16)]}

    def time_pass(weights, tiles):
        return table[(tuple(weights[0].shape), tiles)]

    assert choose_gemv_tiles(shapes, time_pass, [a, b], "auto") == {(64, 32): a, (32, 64): None, (16, 16): None}
    # 'triton' keeps the best tile whatever cuBLAS does.
    assert choose_gemv_tiles(shapes, time_pass, [a, b], "triton") == {(64, 32): a, (32, 64): a, (16, 16): a}


def test_split_tiles_are_timed_only_where_they_divide_k_and_only_when_asked_thin_tiles_unless_refused(monkeypatch) -> None:
    from services.worker.runtime.layers.linear_calibration import (
        GEMV_CANDIDATES,
        GEMV_SPLIT_CANDIDATES,
        GEMV_THIN_CANDIDATES,
        choose_gemv_tiles,
        gemv_candidates,
    )

    plain, split = GemvTiles(16, 1024), GemvTiles(16, 1024, split=3)
    timed = []

    def time_pass(weights, tiles):
        timed.append((tuple(weights[0].shape), tiles))
        return {None: 10.0, plain: 8.0, split: 5.0}[tiles]

    shapes = {shape: [torch.empty(shape)] for shape in [(1024, 3072), (1024, 2048)]}
    chosen = choose_gemv_tiles(shapes, time_pass, [plain, split], "auto")
    # K = 2,048 is not 3 x 1,024 tiles: the split is never launched there.
    assert chosen == {(1024, 3072): split, (1024, 2048): plain}
    assert ((1024, 2048), split) not in timed and ((1024, 3072), split) in timed
    monkeypatch.delenv("RS_GEMV_SPLIT", raising=False)
    monkeypatch.delenv("RS_GEMV_THIN", raising=False)
    assert gemv_candidates() == GEMV_CANDIDATES + GEMV_THIN_CANDIDATES
    monkeypatch.setenv("RS_GEMV_THIN", "0")
    assert gemv_candidates() == GEMV_CANDIDATES
    monkeypatch.setenv("RS_GEMV_SPLIT", "1")
    assert gemv_candidates() == GEMV_CANDIDATES + GEMV_SPLIT_CANDIDATES
    monkeypatch.delenv("RS_GEMV_THIN")
    assert gemv_candidates() == GEMV_CANDIDATES + GEMV_THIN_CANDIDATES + GEMV_SPLIT_CANDIDATES
    assert all(GemvTiles(*c).split > 1 for c in GEMV_SPLIT_CANDIDATES)
    # The thin tiles are plain "rows" tiles with fewer rows a program than the default's 16.
    assert all(GemvTiles(*c).split == 1 and GemvTiles(*c).kind == "rows" and c[0] < 16 for c in GEMV_THIN_CANDIDATES)


def test_choose_gemv_tiles_credits_rows_tiles_with_the_launch_they_absorb() -> None:
    from services.worker.runtime.layers.linear_calibration import choose_gemv_tiles

    rows, dot = GemvTiles(8, 512), GemvTiles(16, 512, kind="dot")
    table = {
        ((64, 32), None): 10.0, ((64, 32), rows): 10.5, ((64, 32), dot): 11.0,   # rows alone loses to cuBLAS
        ((32, 64), None): 10.0, ((32, 64), rows): 8.0, ((32, 64), dot): 8.1,     # dot within its preference
    }
    shapes = {shape: [torch.empty(shape)] for shape in [(64, 32), (32, 64)]}

    def time_pass(weights, tiles):
        return table[(tuple(weights[0].shape), tiles)]

    assert choose_gemv_tiles(shapes, time_pass, [rows, dot], "auto") == {(64, 32): None, (32, 64): dot}
    # A 2-unit norm before each product: cuBLAS and dot tiles pay it, a rows tile does not.
    absorbed = {(64, 32): 2.0, (32, 64): 2.0}
    assert choose_gemv_tiles(shapes, time_pass, [rows, dot], "auto", absorbed) == {(64, 32): rows, (32, 64): rows}


def test_decoder_projections_name_the_prologue_they_can_absorb(qwen3_moe_path) -> None:
    from services.worker.runtime.model_config import ModelConfig
    from services.worker.runtime.model_loader import load_model
    from services.worker.runtime.models.llama import LlamaMLP

    model = load_model(ModelConfig.from_path(qwen3_moe_path, dtype="float32"), "cpu")
    for layer in model.model.layers:
        assert layer.self_attn.qkv_proj.prologue == "rmsnorm"
        assert layer.self_attn.o_proj.prologue is None
        if isinstance(layer.mlp, LlamaMLP):
            assert (layer.mlp.gate_up_proj.prologue, layer.mlp.down_proj.prologue) == ("rmsnorm", "silu_and_mul")
        else:  # the MoE router reads the normed row itself, nothing fused
            assert layer.mlp.gate.prologue is None


def test_select_gemv_tiles_leaves_cpu_models_alone() -> None:
    from services.worker.runtime.layers.linear import ColumnParallelLinear
    from services.worker.runtime.layers.linear_calibration import select_gemv_tiles

    model = torch.nn.Sequential(ColumnParallelLinear(8, [16]).to(torch.bfloat16))
    assert select_gemv_tiles(model, "triton") == {}
    assert model[0].gemv_tiles is None


def test_an_unknown_gemv_backend_is_refused() -> None:
    from services.worker.config import EngineConfig

    with pytest.raises(ValueError, match="gemv_backend must be one of"):
        EngineConfig(model_path="unused", gemv_backend="cutlass")


@pytest.mark.parametrize(("m", "n", "k", "tiles"), [
    (1, 48, 64, GemvTiles(16, 32, kind="dot")),
    (5, 37, 100, GemvTiles(16, 32, kind="dot")),   # ragged rows, columns and K
    (16, 33, 48, GemvTiles(32, 16, kind="dot")),   # the most rows the dot form takes
])
def test_gemv_dot_matches_float32_product(gen, m, n, k, tiles) -> None:
    x = torch.randn((m, k), generator=gen)
    w = torch.randn((n, k), generator=gen)
    out = gemv(x, w, out=poisoned((m, n)), tiles=tiles)
    assert out.shape == (m, n)
    assert rel_error(out, x @ w.t()) < 1e-5


def test_gemv_dot_gives_a_row_the_same_bits_alone_and_among_others(gen) -> None:
    # What keeps speculative verification (k+1 rows) equal to plain decoding (one row).
    w = torch.randn((40, 96), generator=gen)
    rows = torch.randn((6, 96), generator=gen)
    tiles = GemvTiles(16, 32, kind="dot")
    together = gemv(rows, w, tiles=tiles)
    for i in range(6):
        assert torch.equal(gemv(rows[i : i + 1], w, tiles=tiles), together[i : i + 1])
    assert torch.equal(gemv(rows[2], w, tiles=tiles), together[2])


@pytest.mark.parametrize(
    ("m", "tiles"),
    [(1, GemvTiles(8, 32)), (1, GemvTiles(16, 32, kind="dot")), (5, GemvTiles(16, 32, kind="dot"))],
    ids=["rows", "dot-one-row", "dot-five-rows"],
)
def test_a_float32_out_holds_the_half_result_widened(gen, m, tiles) -> None:
    """A CUDA graph's float32 logits written by the LM head's product itself: the same values as the
    half-precision result cast afterwards (rounded to x's dtype first, then widened), not the float32 sums."""
    w = torch.randn((40, 96), generator=gen).half()
    x = torch.randn((m, 96), generator=gen).half()
    out = torch.full((m, 40), float("nan"))
    gemv(x, w, out=out, tiles=tiles)
    half = gemv(x, w, tiles=tiles)
    assert torch.equal(out, half.float())


def test_gemv_refuses_an_out_it_cannot_fill_exactly(gen) -> None:
    x, w = torch.randn((1, 64), generator=gen).half(), torch.randn((8, 64), generator=gen).half()
    with pytest.raises(ValueError, match="out must be torch.float16, or float32 without a split; got torch.int32"):
        gemv(x, w, out=torch.empty((1, 8), dtype=torch.int32), tiles=GemvTiles(8, 32))
    with pytest.raises(ValueError, match="got torch.float32 with split 2"):
        gemv(x, w, out=torch.empty((1, 8)), tiles=GemvTiles(8, 32, split=2))


def test_the_lm_head_writes_a_graphs_float32_logits_itself(gen, monkeypatch) -> None:
    """LogitsProcessor with the batch's logits_out (a CUDA graph's static buffer) and an LM head the GEMV takes:
    the product writes the buffer (no second launch to widen it), with the values of the path that copies."""
    from types import SimpleNamespace

    from services.worker.runtime.forward_batch import ForwardMode
    from services.worker.runtime.layers import linear as linear_mod
    from services.worker.runtime.layers import logits_processor as lp
    from services.worker.runtime.layers.embedding import VocabParallelEmbedding

    monkeypatch.setattr(linear_mod, "_gemv", gemv)
    head = VocabParallelEmbedding(64, 32).half()
    head.weight.data.copy_(torch.randn((64, 32), generator=gen))
    head.gemv_tiles = GemvTiles(16, 32, kind="dot")
    hidden = torch.randn((3, 32), generator=gen).half()
    processor = lp.LogitsProcessor(64)
    batch = SimpleNamespace(return_all_logits=False, forward_mode=ForwardMode.DECODE, logits_out=None)
    copied = processor(hidden, head, batch).clone()
    assert copied.dtype == torch.float32
    batch.logits_out = torch.full((4, 64), float("nan"))

    def no_linear(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the direct path should not call linear()")

    monkeypatch.setattr(lp, "linear", no_linear)
    direct = processor(hidden, head, batch)
    assert direct.data_ptr() == batch.logits_out.data_ptr() and direct.shape == (3, 64)
    assert torch.equal(direct, copied)
    assert batch.logits_out[3].isnan().all()  # rows past the batch untouched
    # Where the GEMV does not take the rows (a "rows" tile, 3 rows) or the head is padded past the vocabulary
    # (48 of 64 rows): linear() and the copy, as before.
    monkeypatch.setattr(lp, "linear", linear_mod.linear)
    head.gemv_tiles = GemvTiles(8, 32)
    assert torch.equal(processor(hidden, head, batch), torch.nn.functional.linear(hidden, head.weight).float())
    padded = VocabParallelEmbedding(48, 32).half()
    padded.weight.data.copy_(torch.randn((64, 32), generator=gen))
    padded.gemv_tiles = GemvTiles(16, 32, kind="dot")
    batch.logits_out = torch.full((4, 48), float("nan"))
    expected = gemv(hidden, padded.weight, tiles=padded.gemv_tiles)[:, :48].float()
    assert torch.equal(lp.LogitsProcessor(48)(hidden, padded, batch), expected)


def test_a_dot_tiled_layer_takes_up_to_16_rows_and_no_more(gen, monkeypatch) -> None:
    from services.worker.runtime.layers import linear as linear_mod

    layer = linear_mod.ReplicatedLinear(32, 24)
    layer.weight.data.copy_(torch.randn((24, 32), generator=gen))
    monkeypatch.setattr(linear_mod, "_gemv", gemv)
    layer.gemv_tiles = GemvTiles(16, 32, kind="dot")
    for m in (1, 7, 16):
        x = torch.randn((m, 32), generator=gen)
        assert rel_error(layer(x), x @ layer.weight.t()) < 1e-5
    x = torch.randn((17, 32), generator=gen)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert layer(torch.randn((0, 32), generator=gen)).shape == (0, 24)


def test_gemv_rejects_too_many_rows_for_the_dot_form(gen) -> None:
    with pytest.raises(ValueError, match="1 to 16 rows of 8"):
        gemv(torch.randn((17, 8), generator=gen), torch.randn((4, 8), generator=gen), tiles=GemvTiles(16, 8, kind="dot"))
    with pytest.raises(ValueError, match="kind must be"):
        gemv(torch.randn((1, 8), generator=gen), torch.randn((4, 8), generator=gen), tiles=GemvTiles(kind="cuda"))


@pytest.mark.parametrize(("n", "k", "tiles"), [
    (48, 64, GemvTiles(16, 32)),      # even K
    (37, 100, GemvTiles(16, 32)),     # ragged rows and K (the norm's statistics see only K features)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv_is_the_norm_then_the_product(gen, n, k, tiles, dtype, with_residual) -> None:
    # The reference is the unfused path the prologue replaces: kernels/rmsnorm.py (itself checked
    # against kernels/reference.py), then a float32 product.
    from kernels.gemv import rmsnorm_gemv
    from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    x = torch.randn((1, k), generator=gen).to(dtype)
    residual = torch.randn((1, k), generator=gen).to(dtype) if with_residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(dtype)
    y, res_out = rmsnorm_gemv(x, residual, norm_w, 1e-6, w, tiles=tiles)
    if with_residual:
        normed, want_res = fused_add_rmsnorm(x, residual, norm_w, 1e-6)
        # The sum every later layer adds to is rounded exactly as the fused norm rounds it.
        assert torch.equal(res_out, want_res)
        assert res_out.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    else:
        normed = rmsnorm(x, norm_w, 1e-6)
        assert res_out is x
    want = normed.float() @ w.float().t()
    assert y.shape == (1, n) and y.dtype == dtype
    assert rel_error(y.float(), want) < (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_gemv_is_the_activation_then_the_product(gen, dtype) -> None:
    from kernels.activation import silu_and_mul
    from kernels.gemv import silu_mul_gemv

    k, n = 72, 40  # ragged against the 32-wide tile
    gate_up = torch.randn((1, 2 * k), generator=gen).to(dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(dtype)
    y = silu_mul_gemv(gate_up, w, tiles=GemvTiles(16, 32))
    want = silu_and_mul(gate_up).float() @ w.float().t()
    assert y.shape == (1, n) and y.dtype == dtype
    assert rel_error(y.float(), want) < (1e-5 if dtype == torch.float32 else 1e-3)


def test_the_gemv_prologues_refuse_what_they_cannot_fuse(gen) -> None:
    from kernels.gemv import rmsnorm_gemv, silu_mul_gemv

    w = torch.randn((8, 16), generator=gen)
    norm_w = torch.ones(16)
    with pytest.raises(ValueError, match="one contiguous row of 16"):
        rmsnorm_gemv(torch.randn((2, 16), generator=gen), None, norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight must be"):
        rmsnorm_gemv(torch.randn((1, 16), generator=gen), None, torch.ones(15), 1e-6, w)
    with pytest.raises(ValueError, match="residual shape"):
        rmsnorm_gemv(torch.randn((1, 16), generator=gen), torch.randn((1, 8), generator=gen), norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="'rows' tiles"):
        rmsnorm_gemv(torch.randn((1, 16), generator=gen), None, norm_w, 1e-6, w, tiles=GemvTiles(kind="dot"))
    with pytest.raises(ValueError, match="one contiguous row of 32"):
        silu_mul_gemv(torch.randn((1, 16), generator=gen), w)


@pytest.mark.parametrize("checkpoint", ["qwen3_path", "qwen3_moe_path"])
def test_batch_one_decode_with_fused_prologues_matches_the_unfused_model(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, checkpoint: str
) -> None:
    # Every projection gets "rows" tiles, as select_gemv_tiles gives them on a GPU: each decoder layer's
    # two norms then run inside qkv_proj and gate_up_proj, and SiLU-and-mul inside down_proj (dense MLPs
    # only; the MoE block keeps its own norm). Logits and the residual stream must match the model
    # with no tiles (torch norms, activation and products).
    from services.worker.runtime.layers import linear as linear_mod
    from services.worker.runtime.model_config import ModelConfig
    from services.worker.runtime.model_loader import load_model
    from services.worker.runtime.models.llama import LlamaMLP
    from tests.forward_helpers import BatchDriver

    config = ModelConfig.from_path(request.getfixturevalue(checkpoint), dtype="float32")
    model = load_model(config, "cpu")
    linear_mod.load_gemv_kernels()
    calls = {"norm": 0, "silu": 0}
    norm_gemv, silu_gemv = linear_mod._rmsnorm_gemv, linear_mod._silu_mul_gemv

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(linear_mod, "_rmsnorm_gemv", count("norm", norm_gemv))
    monkeypatch.setattr(linear_mod, "_silu_mul_gemv", count("silu", silu_gemv))
    projections = [m for m in model.modules() if getattr(m, "prepackable", False) and m.weight.dim() == 2]

    def set_tiles(tiles):
        for m in projections:
            m.gemv_tiles = tiles

    drivers = {"fused": BatchDriver(model, config, max_requests=1, max_tokens=64),
               "plain": BatchDriver(model, config, max_requests=1, max_tokens=64)}
    tiles = {"fused": GemvTiles(16, 32), "plain": None}
    rows = {name: d.new_request() for name, d in drivers.items()}
    for name, d in drivers.items():
        set_tiles(tiles[name])
        d.extend([(rows[name], [5, 9, 14, 3, 7])])
    calls.update(norm=0, silu=0)
    for token in (11, 4, 29):
        logits = {}
        for name, d in drivers.items():
            set_tiles(tiles[name])
            logits[name] = d.decode([(rows[name], token)])
        assert rel_error(logits["fused"], logits["plain"]) < 1e-5
    dense = sum(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers)
    assert calls == {"norm": 3 * (config.num_layers + dense), "silu": 3 * dense}
    for buffers in ("k_buffer", "v_buffer"):
        for layer_id in range(config.num_layers):
            assert rel_error(getattr(drivers["fused"].kv_pool, buffers)[layer_id],
                             getattr(drivers["plain"].kv_pool, buffers)[layer_id]) < 1e-5


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_a_split_over_k_matches_the_product_and_leaves_its_counters_at_zero(gen, monkeypatch, split, prologue) -> None:
    """K split across programs of a row block (each a whole number of 32-column tiles, the parts added by
    the last program in split order): the product of the unsplit kernel within float32 rounding, the same
    bits with one tile or the whole part read ahead, and the ticket counters zero again for the next launch."""
    from kernels.gemv import rmsnorm_gemv, silu_mul_gemv, tiles_read_ahead
    from kernels.split_reduce import ticket_counters

    n, k = 37, 192  # ragged rows; 192 = 2 x 3 x 32
    w = torch.randn((n, k), generator=gen)
    x = torch.randn((1, 2 * k if prologue == "silu_mul" else k), generator=gen)
    res, norm_w = torch.randn((1, k), generator=gen), torch.rand(k, generator=gen) + 0.5

    def run(tiles: GemvTiles) -> torch.Tensor:
        if prologue == "rmsnorm":
            out, res_out = rmsnorm_gemv(x, res, norm_w, 1e-6, w, tiles)
            assert torch.equal(res_out, x + res)
            return out
        if prologue == "silu_mul":
            return silu_mul_gemv(x, w, tiles)
        return gemv(x, w, out=poisoned((n,)), tiles=tiles)

    whole = run(GemvTiles(8, 32))
    parts = run(GemvTiles(8, 32, split=split))
    assert rel_error(parts, whole) < 1e-5
    assert not ticket_counters(w.device).any()
    monkeypatch.setenv("RS_PDL_PRELOAD_SLICE", "1")
    assert tiles_read_ahead(w, 32, split) == min(3, k // split // 32)
    assert torch.equal(run(GemvTiles(8, 32, split=split)), parts)
    assert not ticket_counters(w.device).any()


def test_splits_that_do_not_divide_k_or_dot_tiles_with_a_split_are_refused(gen) -> None:
    x, w = torch.randn((1, 96), generator=gen), torch.randn((16, 96), generator=gen)
    assert GemvTiles(8, 32, split=3).fits(96) and not GemvTiles(8, 32, split=2).fits(96)
    with pytest.raises(ValueError, match="multiple of 2 x block_k"):
        gemv(x, w, tiles=GemvTiles(8, 32, split=2))
    with pytest.raises(ValueError, match="tiles.split must be 1"):
        gemv(x, w, tiles=GemvTiles(8, 32, kind="dot", split=2))
    with pytest.raises(ValueError, match="tiles.split must be 1"):
        gemv(x, w, tiles=GemvTiles(8, 32, split=0))
