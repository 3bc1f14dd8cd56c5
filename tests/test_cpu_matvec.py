"""The C++ single-row product (kernels/cpu_matvec.py) against a float64 reference on every instruction
set path this CPU has, its errors on bad input, its fallback when it cannot be built, and its use by
linear() and by the single-row calibration (layers/linear_calibration.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu_matvec as cpu_matvec
import services.worker.runtime.layers.linear as linear_module
import services.worker.runtime.layers.linear_calibration as calibration_module
from kernels.cpu_matvec import MatvecUnavailable, load_matvec, matvec_isa, use_matvec_isa
from services.worker.runtime.layers.cpu_prepack import cpu_prepack_dtypes, prepack_cpu_weights, prepack_weight
from services.worker.runtime.layers.linear import linear, set_single_row_product
from services.worker.runtime.layers.linear_calibration import calibrate_single_row
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model


def _available() -> str | None:
    try:
        load_matvec()
        return None
    except MatvecUnavailable as exc:
        return str(exc)


_why_not = _available()
needs_matvec = pytest.mark.skipif(
    _why_not is not None, reason=f"the C++ product is not built here: {_why_not}"
)
ISAS = ("avx512", "avx2", "portable")


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction-set path in turn (skipped where this CPU lacks it), the best one restored after."""
    if _why_not is not None:
        pytest.skip(f"the C++ product is not built here: {_why_not}")
    try:
        before = use_matvec_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param
    use_matvec_isa(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def float64_reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T + b in float64, and the sum of the magnitudes of its terms (which bounds the rounding of any
    summation order in float32)."""
    y = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if b is None:
        return y, magnitude
    return y + b.double(), magnitude + b.double().abs()


def assert_float32_close(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> None:
    """Within float32 accumulation error of the float64 reference: K+1 roundings of at most one ulp of
    the running sum, bounded by the sum of |terms|."""
    ref, magnitude = float64_reference(x, w, b)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    bound = (w.shape[1] + 1) * torch.finfo(torch.float32).eps * magnitude
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), float((err / bound).max())


# (N, K): SmolLM2-135M's shapes (qkv, o, gate_up, down, a slice of the LM head), then tails: K not a
# multiple of 16 or 8, N not a multiple of 4 (the last rows one at a time), fewer rows than a block.
SHAPES = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (4096, 576),
    (7, 13),
    (5, 16),
    (3, 1),
    (1, 24),
    (13, 40),
]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matvec_matches_a_float64_reference(
    isa: str, two_threads: None, n: int, k: int, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(1, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    assert matvec_isa() == isa
    y = load_matvec()(x, w, b)
    assert_float32_close(y, x, w, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_matvec_is_the_same_over_any_number_of_threads(isa: str, threads: int) -> None:
    """Each output row is summed by one thread in one order, so the threads only split the rows."""
    w, x = torch.randn(1000, 576), torch.randn(1, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = load_matvec()(x, w)
        torch.set_num_threads(threads)
        assert torch.equal(load_matvec()(x, w), alone)
    finally:
        torch.set_num_threads(before)


PREFETCH_CHECK = """
import sys, torch
from kernels.cpu_matvec import load_matvec, use_matvec_isa
g = torch.Generator().manual_seed(3)
w, x = torch.randn(700, 579, generator=g), torch.randn(1, 579, generator=g)
out = []
for isa in sys.argv[2:]:
    use_matvec_isa(isa)
    out.append(load_matvec()(x, w))
torch.save(out, sys.argv[1])
"""


@needs_matvec
def test_the_weight_prefetch_changes_no_bit(tmp_path) -> None:
    """RS_CPU_PREFETCH_BYTES (read once per process) only adds prefetch requests: off, the default and a far
    distance give the same bits on each vector path; a value that is not a number reads as off."""
    isas = [i for i in ("avx512", "avx2") if _has_isa(i)]
    if not isas:
        pytest.skip("this CPU has no vector path")
    outs = []
    for value in ("0", None, "1536", "65536", "nonsense"):
        env = {k: v for k, v in os.environ.items() if k != "RS_CPU_PREFETCH_BYTES"}
        if value is not None:
            env["RS_CPU_PREFETCH_BYTES"] = value
        dest = tmp_path / f"out_{value}.pt"
        subprocess.run(
            [sys.executable, "-c", PREFETCH_CHECK, str(dest), *isas],
            env=env, check=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        outs.append(torch.load(dest))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def _has_isa(isa: str) -> bool:
    try:
        before = use_matvec_isa(isa)
    except RuntimeError:
        return False
    use_matvec_isa(before)
    return True


@needs_matvec
def test_matvec_takes_a_flat_row_and_rows_of_a_wider_matrix() -> None:
    """x may be [K] (y is then [N]); weight may be a column slice of a wider matrix (row stride > K)."""
    wide, x = torch.randn(64, 100), torch.randn(96)
    w = wide[:, 2:98]
    assert w.stride() == (100, 1)
    y = load_matvec()(x, w)
    assert y.shape == (64,)
    assert_float32_close(y, x, w)


@needs_matvec
@pytest.mark.parametrize(
    "x,w,b,message",
    [
        (
            torch.randn(1, 8, dtype=torch.float64),
            torch.randn(4, 8),
            None,
            "x must be a float32",
        ),
        (torch.randn(1, 8), torch.randn(4, 8).half(), None, "weight must be a float32 or bfloat16"),
        (torch.randn(1, 8), torch.randn(4, 8).bfloat16(), None, "x must be a bfloat16"),
        (torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(4), "bias must be a bfloat16"),
        (torch.randn(2, 8), torch.randn(4, 8), None, "one row"),
        (torch.randn(1, 9), torch.randn(4, 8), None, "x must end in K=8"),
        (torch.randn(1, 8), torch.randn(8, 4).T, None, "rows must be contiguous"),
        (torch.randn(1, 8), torch.randn(32), None, "must be 2-D"),
        (torch.randn(1, 8), torch.randn(4, 8), torch.randn(5), "bias must be a float32 CPU vector of N=4"),
        (torch.randn(1, 8), torch.randn(4, 8), torch.randn(4, dtype=torch.float64), "bias must be"),
    ],
)
def test_matvec_refuses_bad_input_with_a_clear_error(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        load_matvec()(x, w, b)


@needs_matvec
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_bfloat16_row_is_the_float32_product_of_its_widened_values_rounded_once(
    isa: str, two_threads: None, n: int, k: int
) -> None:
    """bfloat16 x, W and b: the float32 path's own sums over the exactly widened values (bit for bit), the
    bias added in float32, one rounding to bfloat16; within that rounding of a float64 reference."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    x, w, b = (torch.randn(shape, generator=gen).bfloat16() for shape in ((1, k), (n, k), (n,)))
    product = load_matvec()
    y = product(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (1, n)
    assert torch.equal(y, product(x.float(), w.float(), b.float()).bfloat16())
    ref = x.double() @ w.double().T + b.double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-3 * k**0.5).all()


@needs_matvec
def test_linear_takes_single_bfloat16_rows_through_matvec_once_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.bfloat16 not in cpu_prepack_dtypes():  # AVX2-only CPUs: oneDNN refuses the bfloat16 reorder
        pytest.skip("oneDNN cannot prepack bfloat16 weights on this CPU")
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    w = torch.randn(300, 96).bfloat16()
    x = torch.randn(1, 96).bfloat16()
    set_single_row_product("matvec")
    y = linear(x, w, None, prepack_weight(w))
    assert torch.equal(y, load_matvec()(x, w)) and y.dtype == torch.bfloat16
    set_single_row_product("plain")


@needs_matvec
def test_an_unknown_instruction_set_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no 'neon' path"):
        use_matvec_isa("neon")


def test_a_failed_build_raises_unavailable_once_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the extension cannot be built, load_matvec says why, and does not try again in the process."""
    import torch.utils.cpp_extension

    calls = []

    def failing_load(**kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'radixserve_cpu_matvec'")

    monkeypatch.setattr(cpu_matvec, "_loaded", None)
    monkeypatch.setattr(cpu_matvec, "_failure", None)
    monkeypatch.setattr(cpu_matvec, "_ensure_ninja", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    for _ in range(2):
        with pytest.raises(MatvecUnavailable, match="Error building extension"):
            load_matvec()
    assert len(calls) == 1


def test_no_ninja_makes_it_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(cpu_matvec, "_loaded", None)
    monkeypatch.setattr(cpu_matvec, "_failure", None)
    monkeypatch.setattr(cpu_matvec.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpu_matvec.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setitem(__import__("sys").modules, "ninja", None)  # import ninja fails
    with pytest.raises(MatvecUnavailable, match="ninja is not installed"):
        load_matvec()


@needs_matvec
def test_linear_takes_single_float32_rows_through_matvec_once_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """After set_single_row_product("matvec"), one row of a prepacked float32 layer goes through the C++
    product (same bits as calling it); two rows keep the packed product; an explicit min_rows (the
    calibration's own passes) keeps the path it names."""
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    w, b = torch.randn(300, 96), torch.randn(300)
    packed = prepack_weight(w)
    x = torch.randn(1, 96)
    set_single_row_product("matvec")
    assert linear_module.PREPACKED_MIN_ROWS == 2
    assert torch.equal(linear(x, w, b, packed), load_matvec()(x, w, b))
    assert torch.equal(linear(x, w, b, packed, min_rows=2), F.linear(x, w, b))
    two = torch.randn(2, 96)
    assert torch.equal(
        linear(two, w, b, packed), torch.ops.mkldnn._linear_pointwise(two, packed, b, "none", [], "")
    )
    set_single_row_product("plain")
    assert linear_module._matvec is None and torch.equal(linear(x, w, b, packed), F.linear(x, w, b))
    with pytest.raises(ValueError, match="'plain', 'packed' or 'matvec'"):
        set_single_row_product("fast")


@needs_matvec
def test_calibration_picks_the_fastest_of_three(llama_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted timings (seconds, CPU share of 2 threads), rounds of plain, packed, matvec: the first
    round disturbed (matvec's threads not busy), then clean rounds where matvec is fastest."""
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    script = iter(
        [(0.030, 1.0), (0.030, 1.9), (0.010, 1.2)] + [(0.030, 1.0), (0.028, 1.9), (0.025, 1.9)] * 10
    )

    def timed(fn):
        fn()
        return next(script)

    monkeypatch.setattr(calibration_module, "_timed", timed)
    best = calibrate_single_row(model, repeats=3)
    assert best == {"plain": 0.030, "packed": 0.028, "matvec": 0.025, "clean_rounds": 3.0}
    assert linear_module._matvec is not None and linear_module.PREPACKED_MIN_ROWS == 2


@needs_matvec
def test_calibration_really_times_the_matvec(llama_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    best = calibrate_single_row(model)
    assert set(best) == {"plain", "packed", "matvec", "clean_rounds"}
    assert all(0 < best[name] < 10 for name in ("plain", "packed", "matvec"))
    fastest = min(("plain", "packed", "matvec"), key=best.__getitem__)
    if best["matvec"] <= best[fastest] * (1 + calibration_module.MATVEC_PREFERENCE):
        fastest = "matvec"  # kept within the preference
    assert (linear_module._matvec is not None) == (fastest == "matvec")
    assert linear_module.PREPACKED_MIN_ROWS == (1 if fastest == "packed" else 2)


def test_calibration_without_the_matvec_logs_why_and_times_two(
    llama_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)

    def unavailable() -> None:
        raise MatvecUnavailable("no C++ compiler")

    monkeypatch.setattr(cpu_matvec, "load_matvec", unavailable)
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    with caplog.at_level(logging.WARNING, logger=calibration_module.__name__):
        best = calibrate_single_row(model)
    assert set(best) == {"plain", "packed", "clean_rounds"}
    assert "cannot use the C++ matrix-vector product" in caplog.text and "no C++ compiler" in caplog.text
    assert linear_module._matvec is None


@needs_matvec
def test_model_logits_through_matvec_match_f_linear(llama_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole decode step of one row through the C++ product against the same step through F.linear."""
    from tests.forward_helpers import BatchDriver

    config = ModelConfig.from_path(llama_path, dtype="float32")
    model = load_model(config, "cpu")
    prepack_cpu_weights(model)
    logits = {}
    for product in ("plain", "matvec"):
        monkeypatch.setattr(linear_module, "_matvec", None)
        set_single_row_product(product)
        driver = BatchDriver(model, config)
        row = driver.new_request()
        driver.extend([(row, [5, 9, 17, 33, 2, 40])])
        logits[product] = driver.decode([(row, 7)])
    ref = logits["plain"]
    assert ((logits["matvec"] - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-5


def rmsnorm64(h: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()


def assert_product_close(y: torch.Tensor, v64: torch.Tensor, w: torch.Tensor) -> None:
    """y against v64 W^T in float64, v64 being the float64 prologue's output: the product's bound plus a
    few roundings of the prologue per term."""
    ref = v64 @ w.double().T
    bound = (w.shape[1] + 8) * torch.finfo(torch.float32).eps * (v64.abs() @ w.double().abs().T)
    assert y.shape == ref.shape and ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (7, 13), (5, 40)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matvec_matches_a_float64_reference(
    isa: str, two_threads: None, n: int, k: int, with_residual: bool
) -> None:
    g = torch.Generator().manual_seed(n + k)
    x, residual = torch.randn(1, k, generator=g), torch.randn(1, k, generator=g) if with_residual else None
    norm_weight, w = torch.rand(k, generator=g) + 0.5, torch.randn(n, k, generator=g) * 0.05
    y, summed = torch.ops.radixserve_cpu.rmsnorm_matvec(x, residual, norm_weight, 1e-5, w)
    h = x + residual if with_residual else x
    assert torch.equal(summed, h) and summed.data_ptr() != x.data_ptr()
    assert_product_close(y, rmsnorm64(h, norm_weight, 1e-5), w)


@pytest.mark.parametrize("n,k", [(576, 1536), (7, 13), (5, 40)])
def test_silu_mul_matvec_matches_a_float64_reference(isa: str, two_threads: None, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    gate_up, w = torch.randn(1, 2 * k, generator=g) * 3, torch.randn(n, k, generator=g) * 0.05
    gate, up = gate_up.double().chunk(2, dim=-1)
    y = torch.ops.radixserve_cpu.silu_mul_matvec(gate_up, w)
    assert_product_close(y, gate * torch.sigmoid(gate) * up, w)


@pytest.mark.parametrize("n,k", [(960, 576), (7, 40)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bfloat16_rmsnorm_matvec_is_torchs_bfloat16_norm_then_the_product(
    isa: str, two_threads: None, n: int, k: int, with_residual: bool
) -> None:
    """bfloat16: x + residual rounded as torch adds, the norm rounded where torch's bfloat16 RMSNorm rounds
    (h * inv, then times the weight; mean(h^2) from a double sum), then the bfloat16 product of that row:
    bit for bit."""
    g = torch.Generator().manual_seed(n + k)
    x = (torch.randn(1, k, generator=g) * 2).bfloat16()
    residual = torch.randn(1, k, generator=g).bfloat16() if with_residual else None
    norm_weight = (torch.rand(k, generator=g) + 0.5).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    y, summed = torch.ops.radixserve_cpu.rmsnorm_matvec(x, residual, norm_weight, 1e-5, w)
    h = x + residual if with_residual else x
    inv = 1.0 / torch.sqrt((h.double().pow(2).sum(-1, keepdim=True) / k).float() + 1e-5)
    normed = norm_weight * (h.float() * inv).bfloat16()
    assert summed.dtype == y.dtype == torch.bfloat16 and torch.equal(summed, h)
    assert torch.equal(y, load_matvec()(normed, w, None))


@pytest.mark.parametrize("n,k", [(576, 1536), (7, 40)])
def test_bfloat16_silu_mul_matvec_is_torchs_bfloat16_swiglu_then_the_product(
    isa: str, two_threads: None, n: int, k: int
) -> None:
    """bfloat16: silu(gate) and its product with up each rounded to bfloat16 (F.silu(gate) * up on bfloat16
    tensors), then the bfloat16 product: within a rounding of that (the exp is libm's, torch's is Sleef's)."""
    g = torch.Generator().manual_seed(n * 3 + k)
    gate_up = (torch.randn(1, 2 * k, generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.ops.radixserve_cpu.silu_mul_matvec(gate_up, w)
    ref = load_matvec()(F.silu(gate) * up, w, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3)


@needs_matvec
def test_the_fused_products_refuse_bad_input() -> None:
    ops, w = torch.ops.radixserve_cpu, torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="gate_up must end in K=16"):
        ops.silu_mul_matvec(torch.randn(1, 8), w)
    with pytest.raises(RuntimeError, match="residual must be shaped like x"):
        ops.rmsnorm_matvec(torch.randn(1, 8), torch.randn(8), torch.ones(8), 1e-6, w)
    with pytest.raises(RuntimeError, match="norm_weight must end in K=8"):
        ops.rmsnorm_matvec(torch.randn(1, 8), None, torch.ones(9), 1e-6, w)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ops.rmsnorm_matvec(torch.randn(1, 8).bfloat16(), None, torch.ones(8), 1e-6, w)
    with pytest.raises(RuntimeError, match="norm_weight must be a bfloat16"):  # every operand the weight's dtype
        ops.rmsnorm_matvec(torch.randn(1, 8).bfloat16(), None, torch.ones(8), 1e-6, w.bfloat16())
    with pytest.raises(RuntimeError, match="gate_up must be a bfloat16"):
        ops.silu_mul_matvec(torch.randn(1, 16), w.bfloat16())


@needs_matvec
def test_layers_fold_the_norm_and_activation_into_the_cpu_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ product chosen, one row's norm -> projection and SwiGLU -> down projection each go
    through one fused call, with what the unfused layers give (within float32 rounding); two rows and
    batch-invariant layers do not."""
    from services.worker.runtime.layers.activation import SiluAndMul
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.layers.linear import (
        ColumnParallelLinear,
        RowParallelLinear,
        norm_then_linear,
    )

    g = torch.Generator().manual_seed(3)
    up, down, norm = ColumnParallelLinear(64, [96, 96]), RowParallelLinear(96, 64), RMSNorm(64, 1e-6)
    for param in (up.weight, down.weight, norm.weight):
        param.data.copy_(torch.randn(param.shape, generator=g) * 0.2 + (1.0 if param is norm.weight else 0.0))
    prepack_cpu_weights(up), prepack_cpu_weights(down)
    monkeypatch.setattr(linear_module, "_matvec", None)
    x, residual = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    with torch.inference_mode():
        hidden, summed = norm(x, residual)
        ref_up = F.linear(hidden, up.weight)
        ref_down = F.linear(SiluAndMul()(ref_up), down.weight)
        set_single_row_product("matvec")
        assert up.fuses_prologue(x) and not up.fuses_prologue(torch.randn(2, 64))
        up.batch_invariant = True  # deterministic inference keeps its own products
        assert not up.fuses_prologue(x)
        up.batch_invariant = False
        gate_up, new_residual = norm_then_linear(norm, up, x, residual)
        y = down.forward_silu_and_mul(gate_up, SiluAndMul())
        set_single_row_product("plain")
        assert not up.fuses_prologue(x)
    assert torch.equal(new_residual, summed)
    for ours, ref in ((gate_up, ref_up), (y, ref_down)):
        assert ((ours - ref).norm() / ref.norm()) <= 1e-5


@pytest.fixture
def no_row_helpers_after() -> Iterator[None]:
    yield
    cpu_matvec.set_row_helpers(0)


@needs_matvec
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_helpers_give_the_one_thread_bits(dtype: torch.dtype, no_row_helpers_after: None) -> None:
    """Products shared with row helpers (kernels/cpu/row_helpers.h) give the one thread's bits: with helpers
    that keep up, and with helpers that sleep after every claim, as preempted ones would, so the caller
    computes again the chunks they claimed (counted as taken over) and their late results are dropped.
    Shapes below two chunks run on the caller alone; the others end on a part chunk."""
    g = torch.Generator().manual_seed(11)
    weights = [(torch.randn(n, 96, generator=g) * 0.1).to(dtype) for n in (63, 64, 65, 100, 960, 3000)]
    x = torch.randn(1, 96, generator=g).to(dtype)
    mv = load_matvec()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [mv(x, w) for w in weights]
        for count, delay_us in ((1, 0), (2, 0), (1, 300)):
            tids = cpu_matvec.set_row_helpers(count, delay_us)
            assert len(tids) == count and all(Path(f"/proc/self/task/{t}").exists() for t in tids)
            helped0, taken0 = cpu_matvec.row_helper_stats()
            for _ in range(10):
                for w, ref in zip(weights, alone):
                    assert torch.equal(mv(x, w), ref)
            deadline = time.monotonic() + 30  # until a helper has claimed a chunk (a busy host may keep it off a core)
            while time.monotonic() < deadline:
                assert torch.equal(mv(x, weights[-1]), alone[-1])
                helped, taken = cpu_matvec.row_helper_stats()
                if (taken > taken0) if delay_us else (helped > helped0):
                    break
            # Helpers that keep up commit chunks; sleeping ones have theirs computed again by the caller.
            assert (taken > taken0) if delay_us else (helped > helped0)
        assert cpu_matvec.set_row_helpers(0) == []
        assert all(torch.equal(mv(x, w), ref) for w, ref in zip(weights, alone))
    finally:
        torch.set_num_threads(before)


@needs_matvec
def test_a_late_row_helper_never_reads_a_freed_weight(no_row_helpers_after: None) -> None:
    """A helper asleep inside a product that has ended may wake after its weight is gone: each product's
    inputs stay held until no helper is inside the job that used them (else this reads unmapped memory)."""
    mv = load_matvec()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, 256, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu_matvec.set_row_helpers(1, 2000)
        for i in range(40):
            w = torch.randn(8192, 256, generator=g)  # 8 MiB: its own mapping, unmapped when freed
            expected = (x.double() @ w.double().T).float()
            assert torch.allclose(mv(x, w), expected, rtol=1e-4, atol=1e-4), i
            del w
    finally:
        torch.set_num_threads(before)


@needs_matvec
def test_row_helpers_bad_counts_are_refused(no_row_helpers_after: None) -> None:
    with pytest.raises(RuntimeError, match="count must be in"):
        torch.ops.radixserve_cpu.set_row_helpers(-1)
    with pytest.raises(RuntimeError, match="delay_us must be in"):
        torch.ops.radixserve_cpu.set_row_helpers(1, -5)


@needs_matvec
def test_row_helpers_off_from_the_environment(monkeypatch: pytest.MonkeyPatch, no_row_helpers_after: None) -> None:
    load_matvec()
    monkeypatch.setenv(cpu_matvec.ROW_HELPERS_ENV, "0")
    assert cpu_matvec.set_row_helpers(1) == []
    monkeypatch.setenv(cpu_matvec.ROW_HELPERS_ENV, "1")
    assert len(cpu_matvec.set_row_helpers(1)) == 1


@pytest.fixture
def product_isa_after() -> Iterator[None]:
    yield
    cpu_matvec.use_product_isa("")


@needs_matvec
def test_the_products_own_loop_changes_only_the_products(product_isa_after: None) -> None:
    """use_product_isa(isa) gives the single-row products isa's loop (their bits are those of the same product
    with every path switched to isa, helpers or not) and leaves the other steps on the CPU's first path;
    use_matvec_isa drops it; a loop this CPU lacks is refused with the ones it has."""
    isas = cpu_matvec.matvec_isas()
    assert isas[-1] == "portable" and cpu_matvec.product_isa() == isas[0] == matvec_isa()
    g = torch.Generator().manual_seed(31)
    w, x = torch.randn(3000, 200, generator=g), torch.randn(1, 200, generator=g)
    mv = load_matvec()
    before = torch.get_num_threads()
    try:
        for isa in isas:
            first = use_matvec_isa(isa)
            reference = mv(x, w)
            use_matvec_isa(first)
            assert cpu_matvec.use_product_isa(isa) == isas[0]
            assert cpu_matvec.product_isa() == isa and matvec_isa() == isas[0]
            assert torch.equal(mv(x, w), reference)
            torch.set_num_threads(1)
            cpu_matvec.set_row_helpers(1)
            try:
                for _ in range(5):
                    assert torch.equal(mv(x, w), reference)
            finally:
                cpu_matvec.set_row_helpers(0)
                torch.set_num_threads(before)
            cpu_matvec.use_product_isa("")
        if len(isas) > 1:
            cpu_matvec.use_product_isa(isas[1])
            use_matvec_isa(isas[0])
            assert cpu_matvec.product_isa() == isas[0]
        with pytest.raises(RuntimeError, match=r"no 'neon' path \(it has: .*portable\)"):
            cpu_matvec.use_product_isa("neon")
    finally:
        torch.set_num_threads(before)


def scripted_passes(monkeypatch: pytest.MonkeyPatch, switch: str, current: Any,
                    times: dict[Any, tuple[float, float]]) -> tuple[list[Any], list[Any]]:
    """Calibration against scripted timings: cpu_matvec's `switch` records each setting asked for (and says
    `current` was the one before), and each timed pass returns `times` of the setting it ran under. Returns
    (the settings asked for since the last timed pass began, the settings of the timed passes in order)."""
    seen: list[Any] = []
    order: list[Any] = []

    def use(value: Any) -> Any:
        seen.append(value)
        return current

    def timed(fn):
        seen.clear()
        fn()
        order.append(seen[0])
        return times[seen[0]]

    monkeypatch.setattr(cpu_matvec, switch, use)
    monkeypatch.setattr(calibration_module, "_timed", timed)
    return seen, order


@needs_matvec
@pytest.mark.parametrize(("avx2_s", "kept"), [(0.020, "avx2"), (0.0245, "avx512")])
def test_calibration_keeps_the_avx2_loop_only_where_it_is_faster(
    llama_path, monkeypatch: pytest.MonkeyPatch, product_isa_after: None, avx2_s: float, kept: str
) -> None:
    """Scripted passes (seconds, CPU share of 2 threads): AVX-512 0.025 s a pass, AVX2 20 % faster (kept for
    the products) or 2 % faster (under PRODUCT_ISA_MIN_GAIN: the first loop stays); the passes alternate."""
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(cpu_matvec, "matvec_isas", lambda: ["avx512", "avx2", "portable"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    seen, order = scripted_passes(monkeypatch, "use_product_isa", "avx512",
                                  {"avx512": (0.025, 1.9), "avx2": (avx2_s, 1.9)})  # fmt: skip
    best = calibration_module.calibrate_product_isa(model, repeats=3)
    assert best == {"avx512": 0.025, "avx2": avx2_s, "clean_rounds": 3.0}
    assert order == ["avx512", "avx2", "avx2", "avx512", "avx512", "avx2"]
    assert seen[-1] == ("avx2" if kept == "avx2" else "")


@needs_matvec
def test_calibration_of_the_products_loop_needs_two_loops(llama_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(cpu_matvec, "matvec_isas", lambda: ["avx2", "portable"])
    assert calibration_module.calibrate_product_isa(model) == {}
    assert calibration_module.calibrate_product_isa(torch.nn.Linear(4, 4)) == {}  # nothing prepacked


@needs_matvec
def test_calibration_really_times_both_loops(llama_path, product_isa_after: None) -> None:
    if cpu_matvec.matvec_isas()[:2] != ["avx512", "avx2"]:
        pytest.skip("this CPU has no AVX-512 loop to time against AVX2")
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    best = calibration_module.calibrate_product_isa(model)
    assert set(best) == {"avx512", "avx2", "clean_rounds"} and 0 < best["avx2"] < 10 and 0 < best["avx512"] < 10
    faster = best["avx2"] < best["avx512"] * (1 - calibration_module.PRODUCT_ISA_MIN_GAIN)
    assert cpu_matvec.product_isa() == ("avx2" if faster else "avx512")


@needs_matvec
@pytest.mark.parametrize(("packed_s", "chosen"), [(0.0245, "matvec"), (0.022, "packed")])
def test_calibration_keeps_the_cpp_product_unless_another_is_clearly_faster(
    llama_path, monkeypatch: pytest.MonkeyPatch, packed_s: float, chosen: str
) -> None:
    """The C++ product (the one row helpers share) is kept within MATVEC_PREFERENCE of the fastest: the packed
    product 2 % faster leaves it, 12 % faster takes its place."""
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    script = iter([(0.040, 1.0), (packed_s, 1.9), (0.025, 1.9)] * 10)
    monkeypatch.setattr(calibration_module, "_timed", lambda fn: (fn(), next(script))[1])
    best = calibrate_single_row(model, repeats=3)
    assert best["packed"] == packed_s and best["matvec"] == 0.025
    assert calibration_module.single_row_product() == chosen


@pytest.fixture
def alone_prefetch_after() -> Iterator[None]:
    yield
    cpu_matvec.use_alone_prefetch(-1)


@needs_matvec
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_stream_without_prefetch_requests_gives_the_same_bits(dtype, alone_prefetch_after: None) -> None:
    """use_alone_prefetch changes only when a lone stream (a team of one, the row helpers' chunks, or
    matvec_alone) asks for its weight's lines: every row's sum is the same, so the same bits as the product
    over two threads; a distance outside -1 .. 1 MiB is refused."""
    g = torch.Generator().manual_seed(40)
    w, x = torch.randn(3000, 200, generator=g).to(dtype), torch.randn(1, 200, generator=g).to(dtype)
    mv = load_matvec()
    before = torch.get_num_threads()
    base, alone = cpu_matvec.prefetch_setting()
    assert alone == -1 and base >= 0
    try:
        torch.set_num_threads(2)
        reference = mv(x, w)
        assert torch.equal(torch.ops.radixserve_cpu.matvec_alone(x, w), reference)
        for nbytes in (0, 4096, -1):
            cpu_matvec.use_alone_prefetch(nbytes)
            assert cpu_matvec.prefetch_setting() == (base, nbytes)
            assert torch.equal(torch.ops.radixserve_cpu.matvec_alone(x, w), reference)
            torch.set_num_threads(1)
            assert torch.equal(mv(x, w), reference)
            cpu_matvec.set_row_helpers(1)
            try:
                assert torch.equal(mv(x, w), reference)
            finally:
                cpu_matvec.set_row_helpers(0)
                torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="bytes must be -1 to 1 MiB, got -2"):
            cpu_matvec.use_alone_prefetch(-2)
        with pytest.raises(RuntimeError, match="matvec_alone: .*"):
            torch.ops.radixserve_cpu.matvec_alone(x[:, :100], w)
    finally:
        torch.set_num_threads(before)


@needs_matvec
@pytest.mark.parametrize(("none_s", "kept"), [(0.0225, 0), (0.0245, -1)])
def test_calibration_drops_a_lone_streams_prefetch_only_where_that_is_faster(
    llama_path, monkeypatch: pytest.MonkeyPatch, alone_prefetch_after: None, none_s: float, kept: int
) -> None:
    """Scripted passes: 0.025 s a lone pass with the requests, 10 % faster without (dropped for lone streams)
    or 2 % (under ALONE_PREFETCH_MIN_GAIN: kept); the passes alternate; no choice where the C++ product is
    not the single rows' or the CPU asks for no lines anyway."""
    model = load_model(ModelConfig.from_path(llama_path, dtype="float32"), "cpu")
    prepack_cpu_weights(model)
    monkeypatch.setattr(calibration_module, "single_row_product", lambda: "matvec")
    monkeypatch.setattr(cpu_matvec, "prefetch_setting", lambda: (1536, -1))
    seen, order = scripted_passes(monkeypatch, "use_alone_prefetch", -1, {-1: (0.025, 0.99), 0: (none_s, 0.99)})
    best = calibration_module.calibrate_alone_prefetch(model, repeats=3)
    assert best == {"prefetch": 0.025, "none": none_s, "clean_rounds": 3.0}
    assert order == [-1, 0, 0, -1, -1, 0]
    assert seen[-1] == kept
    monkeypatch.setattr(cpu_matvec, "prefetch_setting", lambda: (0, -1))  # Zen 3: no requests to drop
    assert calibration_module.calibrate_alone_prefetch(model) == {}
    monkeypatch.setattr(calibration_module, "single_row_product", lambda: "packed")
    assert calibration_module.calibrate_alone_prefetch(model) == {}
