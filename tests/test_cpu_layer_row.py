"""kernels/cpu/layer_row.cpp's decoder_layer_row, a Llama-shaped layer's batch-1 decode step as one op: bit for
bit the registered ops it strings together, called one by one; a tiny Qwen3 and a tiny Llama decoding through
it give the tokens of the layers' usual path (RS_CPU_LAYER_ROW=0), logits within 1e-5, and within 1e-4 of
transformers; the op runs once per layer per step; bad operands get a clear error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kernels.cpu_matvec as cpu_matvec
import services.worker.runtime.layers.linear as linear_module
from services.worker.runtime.layers.cpu_layer_row import LAYER_ROW_ENV
from services.worker.runtime.layers.cpu_prepack import cpu_prepack_available, prepack_cpu_weights
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
