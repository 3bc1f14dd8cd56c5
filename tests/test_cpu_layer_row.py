"""kernels/cpu/layer_row.cpp's decoder_layer_row and decoder_layer_rows, a Llama-shaped layer's decode step as
one op at batch 1 and at larger batches: bit for bit the registered ops each strings together, called one by one
(the batch op over the pool's slots and over dense blocks it appends to, in float32 and bfloat16); a tiny Qwen3
and a tiny Llama decoding through them give the tokens of the layers' usual path (RS_CPU_LAYER_ROW=0), logits
within 1e-5 at batch 1 and equal at batch 3 (bfloat16 too), and within 1e-4 of transformers; the op runs once
per layer per step; bad operands get a clear error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kernels.cpu_matvec as cpu_matvec
import services.worker.runtime.layers.linear as linear_module
from services.worker.runtime.layers.cpu_layer_row import LAYER_ROW_ENV
from services.worker.runtime.layers.cpu_prepack import (
    PANELS_ENV,
    cpu_prepack_available,
    cpu_prepack_dtypes,
    prepack_cpu_weights,
    prepack_weight,
)
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver
from tests.test_cpu_matvec import needs_matvec

pytestmark = needs_matvec


def ops():
    return torch.ops.radixserve_cpu


@pytest.fixture
def single_rows_in_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Single rows of prepacked float32 layers through the C++ product, as calibration picks on most CPUs."""
    if not cpu_prepack_available():
        pytest.skip("this torch has no oneDNN prepacked linear")
    monkeypatch.setattr(linear_module, "_matvec", cpu_matvec.load_matvec())
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)


def test_the_op_is_its_steps_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(5)
    hidden_size, heads, kv_heads, d, inter, slots_n = 96, 6, 2, 16, 160, 40

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    hidden, residual = w(1, hidden_size), w(1, hidden_size)
    in_norm, post_norm, q_norm, k_norm = w(hidden_size) + 1, w(hidden_size) + 1, w(d) + 1, w(d) + 1
    qkv_w, o_w = w((heads + 2 * kv_heads) * d, hidden_size), w(hidden_size, heads * d)
    gate_up_w, down_w = w(2 * inter, hidden_size), w(hidden_size, inter)
    k_pool, v_pool = w(slots_n, kv_heads, d), w(slots_n, kv_heads, d)
    slots = torch.tensor([[3, 9, 4, 17, 30, 2, 11]])
    seq_lens, loc, positions = torch.tensor([7]), torch.tensor([11]), torch.tensor([6])
    cos, sin = w(64, d // 2), w(64, d // 2)
    eps, scale = 1e-6, d**-0.5

    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    qkv, res = ops().rmsnorm_matvec(hidden, residual, in_norm, eps, qkv_w)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    ops().qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm, k_norm, eps, d)
    ops().store_kv_rows_(k, v, k_ref.view(slots_n, -1), v_ref.view(slots_n, -1), loc)
    attn = ops().decode_attention_rows(q.view(1, kv_heads, heads // kv_heads, d), k_ref, v_ref, slots, seq_lens, scale)
    gate_up, res_ref = ops().rmsnorm_matvec(ops().matvec(attn, o_w), res, post_norm, eps, gate_up_w)
    hidden_ref = ops().silu_mul_matvec(gate_up, down_w)

    got_hidden, got_res = ops().decoder_layer_row(
        hidden, residual, in_norm, qkv_w, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w,
        k_pool, v_pool, slots, seq_lens, loc, positions, cos, sin, eps, scale, kv_heads, d,
    )  # fmt: skip
    assert torch.equal(got_hidden, hidden_ref) and torch.equal(got_res, res_ref)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    with pytest.raises(RuntimeError, match="one request"):
        ops().decoder_layer_row(
            hidden, residual, in_norm, qkv_w, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w,
            k_pool, v_pool, slots.repeat(2, 1), seq_lens, loc, positions, cos, sin, eps, scale, kv_heads, d,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="do not hold q plus k and v of 3 heads"):
        ops().decoder_layer_row(
            hidden, residual, in_norm, qkv_w, q_norm, k_norm, o_w, post_norm, gate_up_w, down_w,
            k_pool, v_pool, slots, seq_lens, loc, positions, cos, sin, eps, scale, 3, d,
        )  # fmt: skip


@pytest.mark.parametrize("packing", ["onednn", "panels", "pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dense", [False, True], ids=["pool slots", "dense blocks"])
def test_the_batch_op_is_its_steps_bit_for_bit(dense: bool, dtype: torch.dtype, packing: str) -> None:
    """The layer op on oneDNN's packed weights, and on panels.cpp's (and bfloat16 pair panels) through
    panel_linear."""
    if packing == "onednn" and (not cpu_prepack_available() or dtype not in cpu_prepack_dtypes()):
        pytest.skip(f"this torch has no oneDNN prepacked linear for {dtype}")
    if packing == "pairs" and dtype != torch.bfloat16:
        pytest.skip("pair panels hold bfloat16 weights")
    g = torch.Generator().manual_seed(6)
    hidden_size, heads, kv_heads, d, inter, slots_n, bs = 96, 6, 2, 16, 160, 40, 3

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        if packing != "onednn":
            return ops().panel_linear(x, packed)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def pack(weight: torch.Tensor) -> torch.Tensor:
        return prepack_weight(weight) if packing == "onednn" else ops().pack_panels(weight, packing == "pairs")

    hidden, residual = w(bs, hidden_size), w(bs, hidden_size)
    in_norm, post_norm, q_norm, k_norm = w(hidden_size) + 1, w(hidden_size) + 1, w(d) + 1, w(d) + 1
    qkv_w, o_w = w((heads + 2 * kv_heads) * d, hidden_size), w(hidden_size, heads * d)
    gate_up_w, down_w = w(2 * inter, hidden_size), w(hidden_size, inter)
    qkv_p, o_p, gate_up_p, down_p = map(pack, (qkv_w, o_w, gate_up_w, down_w))
    k_pool, v_pool = w(slots_n, kv_heads, d), w(slots_n, kv_heads, d)
    slots = torch.tensor([[3, 9, 4, 17, 30, 0], [5, 6, 21, 0, 0, 0], [8, 1, 2, 33, 34, 35]])
    seq_lens, loc, positions = torch.tensor([5, 3, 6]), torch.tensor([30, 21, 35]), torch.tensor([4, 2, 5])
    cos, sin = w(64, d // 2).float(), w(64, d // 2).float()  # the rotary tables stay float32
    eps, scale = 1e-6, d**-0.5
    if dense:  # each request's keys one run of 8 rows of the blocks; this step's go to rows new_rows
        k_read, v_read = w(bs * 8, kv_heads, d), w(bs * 8, kv_heads, d)
        read = torch.arange(bs)[:, None] * 8 + torch.arange(6)[None, :]
        new_rows = torch.arange(bs) * 8 + seq_lens - 1
    else:
        k_read, v_read, read, new_rows = k_pool, v_pool, slots, None

    def steps(residual: torch.Tensor | None) -> list[torch.Tensor]:
        """The op's steps one by one on copies of the buffers: hidden, residual, the pools, the read rows."""
        k_ref, v_ref = k_pool.clone(), v_pool.clone()
        kr_ref, vr_ref = (k_ref, v_ref) if not dense else (k_read.clone(), v_read.clone())
        if residual is None:
            x, res = ops().rmsnorm_rows(hidden, in_norm, eps), hidden
        else:
            x, res = ops().add_rmsnorm_rows(hidden, residual, in_norm, eps)
        q, k, v = linear(x, qkv_p).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        ops().qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm, k_norm, eps, d)
        ops().store_kv_rows_(k, v, k_ref.view(slots_n, -1), v_ref.view(slots_n, -1), loc)
        if dense:
            ops().store_kv_rows_(k, v, kr_ref.view(bs * 8, -1), vr_ref.view(bs * 8, -1), new_rows)
        qg = q.reshape(bs, kv_heads, heads // kv_heads, d)
        attn = ops().decode_attention_rows(qg, kr_ref, vr_ref, read, seq_lens, scale)
        gx, res = ops().add_rmsnorm_rows(linear(attn, o_p), res, post_norm, eps)
        return [linear(ops().silu_mul_rows(linear(gx, gate_up_p)), down_p), res, k_ref, v_ref, kr_ref, vr_ref]

    for res_in in (residual, None):  # None: the first layer, whose norm is of hidden (the residual handed on)
        want = steps(res_in)
        pools = [k_pool.clone(), v_pool.clone()]
        reads = [k_read.clone(), v_read.clone()] if dense else pools
        got = ops().decoder_layer_rows(
            hidden, res_in, in_norm, qkv_p, q_norm, k_norm, o_p, post_norm, gate_up_p, down_p, *pools,
            loc, positions, cos, sin, *reads, read, seq_lens, new_rows, eps, scale, kv_heads, d,
        )  # fmt: skip
        for a, b in zip([*got, *pools, *reads], want):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="hidden must be contiguous"):
        ops().decoder_layer_rows(
            hidden.t(), residual, in_norm, qkv_p, q_norm, k_norm, o_p, post_norm, gate_up_p, down_p, k_pool, v_pool,
            loc, positions, cos, sin, k_read, v_read, read, seq_lens, new_rows, eps, scale, kv_heads, d,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="do not hold q plus k and v of 3 heads"):
        ops().decoder_layer_rows(
            hidden, residual, in_norm, qkv_p, q_norm, k_norm, o_p, post_norm, gate_up_p, down_p, k_pool, v_pool,
            loc, positions, cos, sin, k_read, v_read, read, seq_lens, new_rows, eps, scale, 3, d,
        )  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_a_model_decodes_through_it_as_through_its_layers(
    model: str, request: pytest.FixtureRequest, single_rows_in_cpp: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = request.getfixturevalue(f"{model}_path")
    config = ModelConfig.from_path(path, dtype="float32")
    runner = load_model(config, "cpu")
    prepack_cpu_weights(runner)
    prompt = [5, 9, 31, 7, 2, 44, 3, 8]

    def run() -> tuple[list[torch.Tensor], list[int], int]:
        driver = BatchDriver(runner, config)
        row = driver.new_request()
        logits, tokens = [driver.extend([(row, prompt)])], list(prompt)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(8):
                tokens.append(int(logits[-1].argmax(-1)))
                logits.append(driver.decode([(row, tokens[-1])]))
        fused = sum(e.count for e in prof.key_averages() if e.key == "radixserve_cpu::decoder_layer_row")
        return logits, tokens, fused

    ours, tokens, fused = run()
    assert fused == 8 * config.num_layers
    monkeypatch.setenv(LAYER_ROW_ENV, "0")
    layers, layer_tokens, none = run()
    assert none == 0 and tokens == layer_tokens
    for a, b in zip(ours, layers):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ref = hf(torch.tensor([tokens])).logits[0, -1].float()
    assert ((ours[-1][0] - ref).norm() / ref.norm()) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("panels", ["0", "1"], ids=["onednn", "panels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_a_batch_decodes_through_it_as_through_its_layers(
    model: str, dtype: str, panels: str, request: pytest.FixtureRequest, single_rows_in_cpp: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests of different lengths: the first decode step gathers the dense blocks (the modules run),
    the others append to them through the batch op; a request that finishes leaves two, then one (the
    batch-1 op). Logits equal to the modules' at every step, in float32 and in bfloat16 (the modules' own
    bfloat16 steps are checked against torch's bfloat16 ops in tests/test_cpu_rows.py and test_cpu_matvec.py)."""
    onednn = getattr(torch, dtype) in cpu_prepack_dtypes()
    if panels == "0" and not onednn:
        pytest.skip(f"oneDNN cannot prepack {dtype} weights on this CPU")
    if panels == "1" and dtype == "bfloat16" and onednn and not ops().pair_panels_native():
        pytest.skip("bfloat16 takes the panels only where oneDNN cannot pack it or the CPU runs vdpbf16ps")
    monkeypatch.setenv(PANELS_ENV, panels)  # panels.cpp's panels, or oneDNN's layout
    path = request.getfixturevalue(f"{model}_path")
    config = ModelConfig.from_path(path, dtype=dtype)
    runner = load_model(config, "cpu")
    prepack_cpu_weights(runner)
    assert (runner.lm_head.packed_weight.dim() == 3) == (panels == "1")
    prompts = [[5, 9, 31, 7, 2, 44, 3, 8], [11, 4, 6], [21, 22, 23, 24, 25]]

    def run() -> tuple[list[torch.Tensor], dict[str, int]]:
        driver = BatchDriver(runner, config)
        rows = [driver.new_request() for _ in prompts]
        last = driver.extend(list(zip(rows, prompts)))
        tokens = [int(t) for t in last.argmax(-1)]
        logits = [last]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for step in range(9):
                live = 3 if step < 5 else 2 if step < 7 else 1
                logits.append(driver.decode(list(zip(rows[:live], tokens[:live]))))
                tokens = [int(t) for t in logits[-1].argmax(-1)]
        counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("radixserve_cpu::decoder_layer")}
        return logits, counts

    ours, counts = run()
    layers = config.num_layers
    # 5 steps at 3 rows, 2 at 2, the first of each a gather; 2 steps at 1 row.
    assert counts == {"radixserve_cpu::decoder_layer_rows": 5 * layers, "radixserve_cpu::decoder_layer_row": 2 * layers}
    monkeypatch.setenv(LAYER_ROW_ENV, "0")
    reference, none = run()
    assert none == {}
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


def _lone_request(runner, config, steps: int) -> tuple[list[torch.Tensor], dict[str, int]]:
    """A lone request's prefill and `steps` greedy decode steps: the logits of each, and how often each
    radixserve_cpu op ran during the decode steps."""
    prompt = [5, 9, 31, 7, 2, 44, 3, 8]
    driver = BatchDriver(runner, config)
    row = driver.new_request()
    logits, tokens = [driver.extend([(row, prompt)])], list(prompt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax(-1)))
            logits.append(driver.decode([(row, tokens[-1])]))
    return logits, {e.key: e.count for e in prof.key_averages() if e.key.startswith("radixserve_cpu::")}


def _layer_ops(counts: dict[str, int]) -> dict[str, int]:
    return {key: n for key, n in counts.items() if key.startswith("radixserve_cpu::decoder_layer")}


@torch.no_grad()
@pytest.mark.parametrize("product", ["packed", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_rows_on_packed_or_plain_products_take_the_batch_op(
    dtype: str, product: str, qwen3_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where calibration picks the packed product for single rows (oneDNN's AMX bfloat16 products on Intel,
    say), or F.linear on the plain weight (MKL's float32 one on a 2-vCPU Xeon), a lone request's layers go
    through decoder_layer_rows with one row, not layer by layer: its logits equal the modules' at every step,
    bit for bit."""
    if not cpu_prepack_available() or getattr(torch, dtype) not in cpu_prepack_dtypes():
        pytest.skip(f"oneDNN cannot prepack {dtype} weights on this CPU")
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 1 if product == "packed" else 2)
    config = ModelConfig.from_path(qwen3_path, dtype=dtype)
    runner = load_model(config, "cpu")
    prepack_cpu_weights(runner)
    ours, counts = _lone_request(runner, config, 6)
    assert _layer_ops(counts) == {"radixserve_cpu::decoder_layer_rows": 6 * config.num_layers}
    monkeypatch.setenv(LAYER_ROW_ENV, "0")
    reference, counts = _lone_request(runner, config, 6)
    assert _layer_ops(counts) == {}
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


@torch.no_grad()
def test_bfloat16_single_rows_take_the_cpp_product_where_bfloat16_cannot_be_packed(
    qwen3_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2-only CPU packs float32 weights only (oneDNN refuses bfloat16 there): a bfloat16 model's layers
    get no packed copy but are marked cpu_rows, calibration times F.linear against the C++ product alone,
    and with the C++ product a lone request's layers each run as decoder_layer_row, its logits bit for bit
    the modules' on the same product (before, such a model's single rows went through F.linear)."""
    import services.worker.runtime.layers.cpu_prepack as cpu_prepack_module
    from services.worker.runtime.layers.linear import Projection
    from services.worker.runtime.layers.linear_calibration import calibrate_single_row

    monkeypatch.setattr(cpu_prepack_module, "cpu_prepack_dtypes", lambda: (torch.float32,))
    monkeypatch.setenv(PANELS_ENV, "0")  # without panels.cpp's panels, which take such weights (below)
    monkeypatch.setattr(linear_module, "_matvec", None)
    monkeypatch.setattr(linear_module, "PREPACKED_MIN_ROWS", 2)
    config = ModelConfig.from_path(qwen3_path, dtype="bfloat16")
    runner = load_model(config, "cpu")
    prepack_cpu_weights(runner)
    projections = [m for m in runner.modules() if isinstance(m, Projection)]
    assert projections and all(m.packed_weight is None and m.cpu_rows for m in projections)
    best = calibrate_single_row(runner, repeats=1, max_seconds=1.0)
    assert {"plain", "matvec"} <= set(best) and "packed" not in best
    monkeypatch.setattr(linear_module, "_matvec", cpu_matvec.load_matvec())  # as calibration picks here
    ours, counts = _lone_request(runner, config, 4)
    assert _layer_ops(counts) == {"radixserve_cpu::decoder_layer_row": 4 * config.num_layers}
    monkeypatch.setenv(LAYER_ROW_ENV, "0")
    modules, counts = _lone_request(runner, config, 4)
    assert _layer_ops(counts) == {} and counts.get("radixserve_cpu::matvec", 0) > 0
    for a, b in zip(ours, modules):
        assert torch.equal(a, b)
