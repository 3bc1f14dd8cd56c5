"""The CPU paths of the layers against their references: the oneDNN-prepacked linear against
F.linear, the once-per-forward rotary tables against HF's apply_rotary_pos_emb, RMSNorm against HF's
LlamaRMSNorm, and a prepacked model's logits against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import kernels.cpu_matvec as cpu_matvec
from services.worker.runtime.layers.cpu_prepack import (
    cpu_prepack_available,
    cpu_prepack_dtypes,
    prepack_cpu_weights,
    prepack_weight,
)
from services.worker.runtime.layers.layernorm import RMSNorm
from services.worker.runtime.layers.linear import ColumnParallelLinear, linear
from services.worker.runtime.layers.linear_calibration import calibrate_single_row
from services.worker.runtime.layers.rotary import RotaryEmbedding
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver
from tests.test_cpu_matvec import needs_matvec

needs_onednn = pytest.mark.skipif(not cpu_prepack_available(), reason="this torch build has no oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 300])
def test_prepacked_linear_equals_f_linear(rows: int, dtype: torch.dtype) -> None:
    if dtype not in cpu_prepack_dtypes():
        pytest.skip("this CPU has no oneDNN bfloat16 products (AVX2 only); test_bf16_weights_stay_plain... covers it")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(160, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(160, generator=g).to(dtype)
    # min_rows=1: the packed product even for one row (what calibrate_single_row may choose).
    ours = linear(x, w, b, prepack_weight(w), min_rows=1).float()
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ours.shape == ref.shape
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= tol


@needs_onednn
def test_prepack_covers_every_linear_and_the_lm_head(llama_path) -> None:
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    packed = prepack_cpu_weights(model)
    opted_in = [m for m in model.modules() if getattr(m, "prepackable", False)]
    assert opted_in and all(m.packed_weight is not None for m in opted_in)
    assert packed == sum(m.weight.numel() * m.weight.element_size() for m in opted_in)
    assert any(isinstance(m, ColumnParallelLinear) for m in opted_in)
    assert model.lm_head.packed_weight is not None


@needs_onednn
@pytest.mark.parametrize("bf16_supported", [False, True])
def test_bf16_weights_stay_plain_where_the_cpu_cannot_pack_them(
    llama_path, bf16_supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An AVX2-only CPU refuses oneDNN's bf16 reorder (RuntimeError); there a bf16 model keeps F.linear
    # and still loads and runs. Where the CPU can pack bf16 (checked for real), every linear is packed.
    real = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if bf16_supported and not real:
        pytest.skip("this CPU has no oneDNN bfloat16 products")
    if not bf16_supported:
        import services.worker.runtime.layers.cpu_prepack as cpu_prepack

        monkeypatch.setattr(cpu_prepack, "cpu_prepack_dtypes", lambda: (torch.float32,))
    # Without kernels/cpu/panels.cpp's panels, which take such weights (tests/test_cpu_panels.py).
    monkeypatch.setenv("RS_CPU_PANELS", "0")
    model = load_model(ModelConfig.from_path(llama_path, dtype="bfloat16"), "cpu")
    packed = prepack_cpu_weights(model)
    opted_in = [m for m in model.modules() if getattr(m, "prepackable", False)]
    assert all((m.packed_weight is not None) == bf16_supported for m in opted_in)
    assert (packed > 0) == bf16_supported
    layer = next(m for m in opted_in if isinstance(m, ColumnParallelLinear))
    x = torch.randn(3, layer.weight.shape[1], dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float())
    assert ((layer(x).float() - ref).norm() / ref.norm()) < 2e-2


@pytest.fixture
def without_matvec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration between torch's two products only (tests/test_cpu_matvec.py covers the C++ one)."""
    import services.worker.runtime.layers.linear as linear_module
    import services.worker.runtime.layers.linear_calibration as calibration_module

    monkeypatch.setattr(calibration_module, "single_row_matvec", lambda modules: None)
    monkeypatch.setattr(linear_module, "_matvec", None)


@needs_onednn
def test_single_row_calibration_picks_the_faster_path(
    llama_path, monkeypatch: pytest.MonkeyPatch, without_matvec: None
) -> None:
    import services.worker.runtime.layers.linear as linear_module

    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    assert calibrate_single_row(model) == {}  # nothing prepacked yet: nothing to time, nothing changed
    prepack_cpu_weights(model)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    best = calibrate_single_row(model)
    assert set(best) == {"plain", "packed", "clean_rounds"} and 0 < best["plain"] < 10 and 0 < best["packed"] < 10
    assert linear_module.PREPACKED_MIN_ROWS == (1 if best["packed"] < best["plain"] else 2)


@needs_onednn
def test_single_row_calibration_skips_passes_run_beside_other_work(
    llama_path, monkeypatch: pytest.MonkeyPatch, without_matvec: None
) -> None:
    """With a core taken by another process, the packed product's threads wait for each other (its pass
    doubles, the process keeps fewer threads busy) while the one-core plain product does not slow down.
    Such rounds do not count: the choice comes from undisturbed rounds. Scripted timings (seconds, CPU
    share of 2 threads): the first two rounds disturbed, favouring plain; the next ones clean, packed 2x
    faster."""
    import services.worker.runtime.layers.linear as linear_module
    import services.worker.runtime.layers.linear_calibration as calibration_module

    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    script = iter([(0.035, 1.2), (0.040, 1.4)] * 2 + [(0.035, 1.2), (0.017, 1.95)] * 10)

    def timed(fn):
        fn()
        return next(script)

    monkeypatch.setattr(calibration_module, "_timed", timed)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    best = calibrate_single_row(model, repeats=3)
    assert best == {"plain": 0.035, "packed": 0.017, "clean_rounds": 3.0}
    assert linear_module.PREPACKED_MIN_ROWS == 1
    # Disturbed to the end (the time budget runs out with no clean round): the best of all rounds decides.
    script = iter([(0.035, 1.2), (0.040, 1.4)] * 1000)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 1)
    best = calibrate_single_row(model, repeats=3, max_seconds=0.05)
    assert best == {"plain": 0.035, "packed": 0.040, "clean_rounds": 0.0}
    assert linear_module.PREPACKED_MIN_ROWS == 2


@needs_onednn
@torch.no_grad()
@pytest.mark.parametrize("panels", ["0", pytest.param("1", marks=needs_matvec)], ids=["onednn", "panels"])
def test_prepacked_model_logits_match_transformers(llama_path, panels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's layout, and kernels/cpu/panels.cpp's panels (RS_CPU_PANELS=1, where the C++ library builds)."""
    monkeypatch.setenv("RS_CPU_PANELS", panels)
    config = ModelConfig.from_path(llama_path, dtype="float32")
    model = load_model(config, "cpu")
    prepack_cpu_weights(model)
    assert (model.lm_head.packed_weight.dim() == 3) == (panels == "1")
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [[5, 9, 17, 33, 2 + i, 40 + 3 * i] for i in range(4)]  # 24 rows: the prepacked path
    driver = BatchDriver(model, config)
    rows = [driver.new_request() for _ in prompts]
    logits = driver.extend(list(zip(rows, prompts)), return_all_logits=True)
    ref = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
    assert ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-4
    # Then one decode step of 4 rows, also prepacked, against HF on the prompts plus that token.
    step = driver.decode([(row, 7) for row in rows])
    ref = torch.stack([hf(torch.tensor([p + [7]])).logits[0, -1].float() for p in prompts])
    assert ((step - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-4


def test_rotary_tables_once_per_forward_equal_hf_rotation() -> None:
    head_dim, max_pos = 64, 512
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rope = RotaryEmbedding(head_dim, inv_freq, max_pos)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, max_pos, (7,), generator=g)
    q, k = torch.randn(7, 4 * head_dim, generator=g), torch.randn(7, 2 * head_dim, generator=g)
    ours_q, ours_k = rope(positions, q, k)
    # HF: cos/sin [tokens, head_dim] (the half tables repeated), heads on dim 1 via unsqueeze_dim.
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(7, 4, head_dim), k.view(7, 2, head_dim), emb.cos(), emb.sin(), unsqueeze_dim=1
    )
    assert torch.equal(ours_q, ref_q.flatten(1)) and torch.equal(ours_k, ref_k.flatten(1))
    # A second layer with the same positions reuses the tables; new positions rebuild them.
    tables = rope._tables
    rope(positions, q, k)
    assert rope._tables is tables
    rope(positions.clone(), q, k)
    assert rope._tables is not tables


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_float32_on_torch_ops_is_bit_identical_to_hf(with_residual: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch steps (RS_CPU_ROW_OPS=0, or no C++ library) round as HF's do. The C++ op that takes float32
    rows where the library is loaded sums the squares in double: tests/test_cpu_rows.py holds it to float64
    and to within an ulp of these steps."""
    monkeypatch.setattr(cpu_matvec, "_row_ops", None)
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    ours, hf = RMSNorm(48, 1e-5), LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48, generator=g))
        hf.weight.copy_(ours.weight)
    if with_residual:
        y, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(y, hf(x + residual))
    else:
        assert torch.equal(ours(x), hf(x))


@needs_onednn
def test_the_engine_reports_its_single_row_product(llama_path) -> None:
    """get_info names the product single rows use, with the timings that chose it (a load beside a busy
    process can choose a slower one; this is how to see it)."""
    import services.worker.runtime.layers.linear as linear_module
    from services.worker.frontend.engine import Engine

    with Engine(str(llama_path), dtype="float32") as engine:
        chosen = engine.get_server_info()["cpu_single_row"]
        min_rows, matvec = linear_module.PREPACKED_MIN_ROWS, linear_module._matvec
        alone = cpu_matvec.prefetch_setting() if matvec is not None else None
    from services.worker.runtime.layers.linear_calibration import MATVEC_PREFERENCE

    timed = {name: chosen[f"{name}_ms"] for name in ("plain", "packed", "matvec") if f"{name}_ms" in chosen}
    fastest = min(timed, key=timed.__getitem__)
    kept = "matvec" in timed and timed["matvec"] <= timed[fastest] * (1 + MATVEC_PREFERENCE)
    assert {"plain", "packed"} <= set(timed) and chosen["product"] == ("matvec" if kept else fastest)
    if "matvec" in timed and cpu_matvec.matvec_isas()[:2] == ["avx512", "avx2"]:
        assert chosen["matvec_loop"] in ("avx512", "avx2")  # the products' loop, timed at load too
    if alone is not None and alone[0] > 0:  # a lone stream's prefetch requests, timed at load on such a CPU
        assert chosen["alone_prefetch"] == (alone[1] != 0)
    assert min_rows == (1 if chosen["product"] == "packed" else 2)
    assert (matvec is not None) == (chosen["product"] == "matvec")
    with Engine(str(llama_path), dtype="float32", cpu_weight_prepack=False) as engine:
        assert engine.get_server_info()["cpu_single_row"] is None
