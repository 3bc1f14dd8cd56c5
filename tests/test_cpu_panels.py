"""kernels/cpu/panels.cpp's products of a few rows over 12-column weight panels: float32 against a float64
reference on each path this CPU has (AVX2 and the portable loop, bit for bit the same), bfloat16 as the float32
product of the widened values rounded once (or, as pair panels, vdpbf16ps' sums, its portable copy the same
bits), each row the same bits alone as in any batch, its errors on bad input, and the prepacking that chooses the panels (layers/cpu_prepack.py, RS_CPU_PANELS) with linear() and the
batch-invariant product multiplying through them."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_matvec import use_matvec_isa
from services.worker.runtime.layers.batch_invariant import invariant_linear
from services.worker.runtime.layers.cpu_prepack import (
    PANELS_ENV,
    prepack_cpu_weights,
    use_pair_panels,
    use_panels,
)
from services.worker.runtime.layers.linear import linear
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.test_cpu_matvec import assert_float32_close, isa, needs_matvec  # noqa: F401 (isa: each path in turn)

pytestmark = needs_matvec

# (N, K): full panels only, a tail of 4 (N = 1,024 as Qwen3's hidden size), a single narrow panel, K past and
# short of the 256-k block and of a multiple of 8.
SHAPES = [(960, 576), (1024, 300), (5, 7), (36, 513), (25, 1040)]
ROWS = [1, 2, 7, 8, 9, 16, 17, 24, 25, 50]


def ops():
    return torch.ops.radixserve_cpu


@pytest.mark.usefixtures("isa")  # each path this CPU has (AVX-512: 16-lane tiles past 8 rows)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_panel_linear_matches_the_float64_reference(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    panels = ops().pack_panels(w)
    assert panels.shape == (1, n, k) and sorted(panels.flatten().tolist()) == sorted(w.flatten().tolist())
    for m in ROWS:
        x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        assert_float32_close(ops().panel_linear(x, panels, b), x, w, b)
        assert_float32_close(ops().panel_linear(x, panels), x, w)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_each_row_is_the_same_bits_alone_and_on_every_path(shape: tuple[int, int]) -> None:
    """Each output is one chain of multiply-adds over k in order, whatever the rows beside it, the tile or the
    path: alone == batched, and the portable loop == AVX2 == AVX-512 (whichever this CPU has), bit for bit."""
    n, k = shape
    g = torch.Generator().manual_seed(7)
    panels = ops().pack_panels(torch.randn(n, k, generator=g))
    x, b = torch.randn(50, k, generator=g), torch.randn(n, generator=g)
    batched = ops().panel_linear(x, panels, b)
    for m in (1, 9, 24, 31):
        assert torch.equal(ops().panel_linear(x[:m], panels, b), batched[:m])
    assert torch.equal(torch.cat([ops().panel_linear(x[i : i + 1], panels, b) for i in range(50)]), batched)
    before = torch.ops.radixserve_cpu.matvec_isa()
    tried = []
    try:
        for path in ("portable", "avx2", "avx512"):
            try:
                use_matvec_isa(path)
            except RuntimeError:
                continue  # this CPU lacks it
            tried.append(path)
            assert torch.equal(ops().panel_linear(x, panels, b), batched), path
    finally:
        use_matvec_isa(before)
    assert "portable" in tried


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_bfloat16_is_the_float32_product_of_the_widened_values_rounded_once(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    panels, wide = ops().pack_panels(w), ops().pack_panels(w.float())
    assert panels.dtype == torch.bfloat16 and panels.shape == (1, n, k)
    for m in (1, 9, 16, 25):
        x, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        y = ops().panel_linear(x, panels, b)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, ops().panel_linear(x.float(), wide, b.float()).bfloat16())
        assert torch.equal(ops().panel_linear(x[:1], panels, b), y[:1])
        ref = F.linear(x.double(), w.double(), b.double())
        assert ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_team_of_threads_gives_the_same_bits(dtype: torch.dtype) -> None:
    """The threads share the chunks of panels (each its own from the front, then the others' from the back):
    every chunk is computed once whatever the team, and by whichever thread, to the same bits."""
    g = torch.Generator().manual_seed(11)
    n, k = 12 * 4 * 9 + 5, 300  # 10 chunks of 4 panels, the last one a narrow tail
    w = torch.randn(n, k, generator=g).to(dtype)
    panels = ops().pack_panels(w)
    x, b = torch.randn(40, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 16):
            torch.set_num_threads(threads)
            results.append((ops().panel_linear(x, panels, b), ops().panel_linear(x[:16], panels)))
    finally:
        torch.set_num_threads(before)
    for full, rows16 in results[1:]:
        assert torch.equal(full, results[0][0]) and torch.equal(rows16, results[0][1])
    if dtype == torch.float32:
        assert_float32_close(results[0][0], x, w, b)


def _pair_paths() -> list[str]:
    """The paths the pair panels take here: vdpbf16ps where this CPU runs it, the portable copy always."""
    return ["native", "portable"] if ops().pair_panels_native() else ["portable"]


@pytest.mark.parametrize("path", _pair_paths())
@pytest.mark.parametrize("shape", SHAPES[:2] + [(5, 6), (25, 1040)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_pair_panels_match_the_float64_reference_alone_or_batched(shape: tuple[int, int], path: str) -> None:
    """pack_panels(w, pairs=True): [2, N, K / 2], the k pairs of a column one 32-bit word; panel_linear's sums
    are vdpbf16ps' (or its portable copy's), within bfloat16's rounding of the float64 product, each row the
    same bits alone as in any batch and on either path."""
    n, k = shape
    g = torch.Generator().manual_seed(n + 3 * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    pairs = ops().pack_panels(w, True)
    assert pairs.shape == (2, n, k // 2) and pairs.dtype == torch.bfloat16
    assert sorted(pairs.flatten().float().tolist()) == sorted(w.flatten().float().tolist())
    x, b = torch.randn(50, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    before = torch.ops.radixserve_cpu.matvec_isa()
    try:
        if path == "portable":
            use_matvec_isa("portable")
        y = ops().panel_linear(x, pairs, b)
        assert y.dtype == torch.bfloat16 and y.shape == (50, n)
        ref = x.double() @ w.double().T + b.double()
        assert ((y.double() - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)).max() <= 2**-7
        for m in (1, 9, 16, 17, 33):
            assert torch.equal(ops().panel_linear(x[:m], pairs, b), y[:m])
        assert torch.equal(torch.cat([ops().panel_linear(x[i : i + 1], pairs, b) for i in range(50)]), y)
    finally:
        use_matvec_isa(before)
    if path == "native":  # the portable copy of vdpbf16ps' arithmetic is the same bits as the instruction
        use_matvec_isa("portable")
        try:
            assert torch.equal(ops().panel_linear(x, pairs, b), y)
        finally:
            use_matvec_isa(before)


def test_pair_panels_flush_denormals_as_vdpbf16ps_does() -> None:
    """Denormal inputs read as zero and denormal sums flush to zero (vdpbf16ps' rules), on either path; the
    widening panels keep them (an exact float32 product)."""
    w = torch.tensor([[1e-20, 1.0], [1e-39, 1.0]], dtype=torch.bfloat16)  # 1e-39: a bfloat16 denormal
    x = torch.tensor([[1e-19, 0.0], [1.0, 0.0]], dtype=torch.bfloat16)
    before = torch.ops.radixserve_cpu.matvec_isa()
    results = []
    try:
        for path in _pair_paths():
            use_matvec_isa("portable" if path == "portable" else before)
            results.append(ops().panel_linear(x, ops().pack_panels(w, True)))
    finally:
        use_matvec_isa(before)
    for y in results:
        assert y[0, 0] == 0 and y[1, 1] == 0  # 1e-20 * 1e-19 is a float32 denormal; 1e-39 reads as 0
        assert torch.equal(y, results[0])
    wide = ops().panel_linear(x, ops().pack_panels(w))
    assert wide[1, 1] != 0


def test_a_product_over_no_k_is_the_bias() -> None:
    for dtype, pairs in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        panels = ops().pack_panels(torch.randn(5, 0).to(dtype), pairs)
        b = torch.randn(5).to(dtype)
        assert torch.equal(ops().panel_linear(torch.randn(3, 0).to(dtype), panels, b), b.expand(3, 5))
        assert torch.equal(ops().panel_linear(torch.randn(3, 0).to(dtype), panels), torch.zeros(3, 5, dtype=dtype))


def test_pair_panels_refuse_what_they_cannot_pack() -> None:
    with pytest.raises(RuntimeError, match="pairs need a bfloat16 weight with an even K"):
        ops().pack_panels(torch.randn(4, 6), True)
    with pytest.raises(RuntimeError, match="pairs need a bfloat16 weight with an even K"):
        ops().pack_panels(torch.randn(4, 7).bfloat16(), True)
    pairs = ops().pack_panels(torch.randn(4, 6).bfloat16(), True)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 6\]"):
        ops().panel_linear(torch.randn(2, 3).bfloat16(), pairs)
    with pytest.raises(RuntimeError, match=r"x \(Float\) must have the panels' dtype"):
        ops().panel_linear(torch.randn(2, 6), pairs)
    with pytest.raises(RuntimeError, match="panels must be pack_panels' contiguous"):
        ops().panel_linear(torch.randn(2, 6), torch.randn(2, 4, 3))  # float32 [2, N, K / 2]: no pairs


def test_strided_rows_give_the_contiguous_rows_results() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 40, generator=g)
    panels = ops().pack_panels(w)
    wide = torch.randn(20, 64, generator=g)
    for x in (wide[:, 3:43], torch.randn(40, 20, generator=g).t(), wide[::2, :40]):
        assert torch.equal(ops().panel_linear(x, panels), ops().panel_linear(x.contiguous(), panels))
        assert_float32_close(ops().panel_linear(x, panels), x, w)
    assert ops().panel_linear(torch.zeros(0, 40), panels).shape == (0, 50)


def test_bad_input_is_refused_with_a_message() -> None:
    w = torch.randn(24, 16)
    panels = ops().pack_panels(w)
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16 CPU tensor"):
        ops().panel_linear(torch.randn(2, 16, dtype=torch.float64), panels)
    with pytest.raises(RuntimeError, match=r"x \(BFloat16\) must have the panels' dtype \(Float\)"):
        ops().panel_linear(torch.randn(2, 16, dtype=torch.bfloat16), panels)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 16\]"):
        ops().panel_linear(torch.randn(2, 15), panels)
    with pytest.raises(RuntimeError, match="panels must be pack_panels' contiguous"):
        ops().panel_linear(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match=r"bias must be \[24\]"):
        ops().panel_linear(torch.randn(2, 16), panels, torch.randn(12))
    with pytest.raises(RuntimeError, match=r"weight must be \[N, K\]"):
        ops().pack_panels(torch.randn(24))
    with pytest.raises(RuntimeError, match="weight must be a float32 or bfloat16 CPU tensor"):
        ops().pack_panels(w.double())
    with pytest.raises(RuntimeError, match="bias must be a CPU tensor of the panels' dtype"):
        ops().panel_linear(torch.randn(2, 16), panels, torch.randn(24, dtype=torch.bfloat16))


def test_prepacking_takes_the_panels_as_rs_cpu_panels_says(llama_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RS_CPU_PANELS=1: every float32 linear (and the LM head) gets [1, N, K] panels, which linear() and the
    batch-invariant product multiply through; 0: oneDNN's blocked copies. Unset: the panels where the
    products' best path is AVX2."""
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    monkeypatch.setenv(PANELS_ENV, "0")
    assert not use_panels()
    prepack_cpu_weights(model)
    assert not any(m.packed_weight.dim() == 3 for m in model.modules() if getattr(m, "packed_weight", None) is not None)
    monkeypatch.setenv(PANELS_ENV, "1")
    assert use_panels()
    prepack_cpu_weights(model)
    packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    assert packed and model.lm_head in packed
    assert all(not m.packed_weight.is_mkldnn and m.packed_weight.shape == (1, *m.weight.shape) for m in packed)
    g = torch.Generator().manual_seed(1)
    for m in packed[:6]:
        x = torch.randn(19, m.weight.shape[1], generator=g)
        y = linear(x, m.weight, None, m.packed_weight)
        assert torch.equal(y, ops().panel_linear(x, m.packed_weight))
        assert ((y - F.linear(x, m.weight)).norm(dim=-1) / F.linear(x, m.weight).norm(dim=-1)).max() <= 1e-5
        alone = torch.cat([invariant_linear(x[i : i + 1], m.weight, None, m.packed_weight) for i in range(19)])
        assert torch.equal(alone, invariant_linear(x, m.weight, None, m.packed_weight))
    monkeypatch.delenv(PANELS_ENV)
    assert use_panels() == (torch.ops.radixserve_cpu.matvec_isa() == "avx2")


@pytest.mark.parametrize("onednn_bf16", [False, True])
def test_bfloat16_weights_take_the_panels_where_onednn_cannot_pack_them(
    llama_path, onednn_bf16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2-only CPU cannot pack bfloat16 for oneDNN: with the panels its bfloat16 weights take them (and
    a batch's rows go through panel_linear); where oneDNN can, bfloat16 keeps oneDNN's layout, unless the CPU
    runs vdpbf16ps (then RS_CPU_PANELS=1 takes the pair panels)."""
    import services.worker.runtime.layers.cpu_prepack as cpu_prepack

    if onednn_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bfloat16 products")
    if not onednn_bf16:
        monkeypatch.setattr(cpu_prepack, "cpu_prepack_dtypes", lambda: (torch.float32,))
    monkeypatch.setenv(PANELS_ENV, "1")
    model = load_model(ModelConfig.from_path(llama_path, dtype="bfloat16"), "cpu")
    prepack_cpu_weights(model)
    packed = [m for m in model.modules() if getattr(m, "prepackable", False)]
    assert packed and all(m.packed_weight is not None for m in packed)
    # Where the CPU runs vdpbf16ps, RS_CPU_PANELS=1 takes the pair panels.
    pairs = ops().pair_panels_native()
    for m in packed:
        n, k = m.weight.shape
        want = (2, n, k // 2) if pairs else (1, n, k) if not onednn_bf16 else None
        assert (m.packed_weight.shape == want) if want else m.packed_weight.is_mkldnn
    layer = packed[0]
    x = torch.randn(5, layer.weight.shape[1], dtype=torch.bfloat16)
    y = linear(x, layer.weight, None, layer.packed_weight)
    if not layer.packed_weight.is_mkldnn:
        assert torch.equal(y, ops().panel_linear(x, layer.packed_weight))
    ref = F.linear(x.double(), layer.weight.double())
    assert ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-2


def test_on_avx512_prepacking_takes_the_layout_whose_products_were_faster(
    llama_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the products' best path is AVX-512 (unset RS_CPU_PANELS), the panels only if their 16-row products
    of the model's first weights beat oneDNN's; without a model to time, oneDNN's layout."""
    import kernels.cpu_matvec as cpu_matvec
    import services.worker.runtime.layers.cpu_prepack as cpu_prepack

    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    seconds = cpu_prepack.panels_against_onednn(model, rounds=2)
    assert set(seconds) == {"panels", "onednn"} and all(0 < t < 1 for t in seconds.values())
    monkeypatch.delenv(PANELS_ENV, raising=False)
    monkeypatch.setattr(cpu_matvec, "matvec_isa", lambda: "avx512")
    assert not use_panels()
    for panels, onednn in ((1e-3, 2e-3), (2e-3, 1e-3)):
        monkeypatch.setattr(cpu_prepack, "panels_against_onednn", lambda m, dtype=None, p=panels, o=onednn: {"panels": p, "onednn": o})
        assert use_panels(model) == (panels < onednn)
        prepack_cpu_weights(model)
        assert (model.lm_head.packed_weight.dim() == 3) == (panels < onednn)


def test_bfloat16_pair_panels_are_taken_where_vdpbf16ps_runs_and_they_were_faster(
    llama_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset RS_CPU_PANELS: bfloat16 weights of an even K take the pair panels where the library runs vdpbf16ps
    and their 16-row products of the model's first bfloat16 weights beat oneDNN's; =0 never, =1 wherever
    vdpbf16ps runs. Through them, linear() is panel_linear's product, close to F.linear's."""
    import services.worker.runtime.layers.cpu_prepack as cpu_prepack

    if torch.bfloat16 not in cpu_prepack.cpu_prepack_dtypes():
        pytest.skip("oneDNN cannot pack bfloat16 here: the choice is against its products")
    model = load_model(ModelConfig.from_path(llama_path, dtype="bfloat16"), "cpu")
    seconds = cpu_prepack.panels_against_onednn(model, rounds=2, dtype=torch.bfloat16)
    assert set(seconds) == {"panels", "onednn"} and all(0 < t < 1 for t in seconds.values())
    monkeypatch.delenv(PANELS_ENV, raising=False)
    monkeypatch.setattr(torch.ops.radixserve_cpu, "pair_panels_native", lambda: True)
    assert not use_pair_panels()  # no model to time
    for pairs, onednn in ((1e-3, 2e-3), (2e-3, 1e-3)):
        monkeypatch.setattr(
            cpu_prepack, "panels_against_onednn",
            lambda m, rounds=None, dtype=None, p=pairs, o=onednn: {"panels": p, "onednn": o},
        )  # fmt: skip
        assert use_pair_panels(model) == (pairs < onednn)
        prepack_cpu_weights(model)
        packed = model.lm_head.packed_weight
        n, k = model.lm_head.weight.shape
        assert packed.shape == (2, n, k // 2) if pairs < onednn else packed.is_mkldnn
    x = torch.randn(7, k, dtype=torch.bfloat16)
    model.lm_head.packed_weight = ops().pack_panels(model.lm_head.weight, True)
    y = linear(x, model.lm_head.weight, None, model.lm_head.packed_weight)
    assert torch.equal(y, ops().panel_linear(x, model.lm_head.packed_weight))
    ref = F.linear(x.double(), model.lm_head.weight.double())
    assert ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-2
    monkeypatch.setenv(PANELS_ENV, "0")
    assert not use_pair_panels(model)
    monkeypatch.setenv(PANELS_ENV, "1")
    assert use_pair_panels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_helpers_give_the_one_thread_bits(dtype: torch.dtype) -> None:
    """Panel products shared with row helpers (kernels/cpu/row_helpers.h: chunks of 4 panels through every row
    block, each into the claimer's buffer, written out by the thread that commits it) give the one thread's
    bits, with helpers that keep up and with helpers that sleep after every claim (so their chunks are taken
    over), with and without a bias, over one row block and several (bfloat16: the chunk's weights widened)."""
    from kernels.cpu_matvec import row_helper_stats, set_row_helpers

    g = torch.Generator().manual_seed(21)
    cases = []
    for n, k in ((3000, 128), (100, 40), (13, 8)):
        panels = ops().pack_panels((torch.randn(n, k, generator=g) * 0.1).to(dtype))
        for m in (2, 24, 70):
            cases.append((torch.randn(m, k, generator=g).to(dtype), panels, torch.randn(n, generator=g).to(dtype)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [(ops().panel_linear(x, p, b), ops().panel_linear(x, p)) for x, p, b in cases]
        for count, delay_us in ((1, 0), (1, 300)):
            set_row_helpers(count, delay_us)
            helped0, taken0 = row_helper_stats()
            for _ in range(3):
                for (x, p, b), (with_bias, without) in zip(cases, alone):
                    assert torch.equal(ops().panel_linear(x, p, b), with_bias)
                    assert torch.equal(ops().panel_linear(x, p), without)
            x, p, b = cases[2]  # 3,000 columns, 70 rows: 63 chunks
            deadline = time.monotonic() + 30  # until a helper has claimed a chunk (a busy host may keep it off a core)
            while time.monotonic() < deadline:
                assert torch.equal(ops().panel_linear(x, p, b), alone[2][0])
                helped, taken = row_helper_stats()
                if (taken > taken0) if delay_us else (helped > helped0):
                    break
            assert (taken > taken0) if delay_us else (helped > helped0)
    finally:
        set_row_helpers(0)
        torch.set_num_threads(before)
