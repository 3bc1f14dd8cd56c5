"""FP8 weights for Qwen3.5 (hybrid Gated DeltaNet + gated attention, dense and MoE) on the CPU, where the
FP8 product is the dequantizing reference: a checkpoint in the published Qwen3.5 FP8 layout (q/k/v/o,
in_proj_qkv, in_proj_z, out_proj, the MLP, experts and shared expert quantized; in_proj_a/b, conv1d,
A_log, dt_bias, norms, router, shared-expert gate, embeddings and LM head not) kept resident in FP8
against the same checkpoint dequantized to float32, and `--quantization fp8` on a plain checkpoint against
the model holding its weights quantized then dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.runtime.layers.fp8 import dequantize_blocks
from tests.checkpoints import tiny_qwen3_5_config, tiny_qwen3_5_moe_config, write_checkpoint
from tests.fp8_helpers import write_fp8_pair
from tests.test_fp8_resident import assert_same_run, engine_run, fp8_params, load, naive_fp8, run_greedy

BLOCK = (16, 16)
# The layers whose weights are FP8 in both ways in: fused as the model holds them.
FP8_SUFFIXES = ("_proj.weight", ".in_proj.weight", ".w13_weight", ".w2_weight")


def expected_fp8(names: list[str]) -> set[str]:
    """The model's parameters an FP8 Qwen3.5 keeps in FP8: attention, Gated DeltaNet in/out projections,
    MLPs, experts, shared experts (not the router `mlp.gate`, `shared_expert_gate`, conv, norms, heads)."""
    return {n for n in names if n.startswith("model.layers.") and n.endswith(FP8_SUFFIXES)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def plain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_qwen3_5_config() if request.param == "dense" else tiny_qwen3_5_moe_config()
    return write_checkpoint(tmp_path_factory.mktemp(f"q35_{request.param}"), config, seed=11)


@pytest.fixture(scope="module")
def fp8_pair(plain: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the published FP8 layout in 16x16 blocks, the plain checkpoint of its dequantized weights)."""
    return write_fp8_pair(plain, tmp_path_factory.mktemp(f"{plain.name}_fp8"), BLOCK)


def test_checkpoint_layout_is_the_published_one(fp8_pair: tuple[Path, Path]) -> None:
    from safetensors import safe_open

    with safe_open(str(fp8_pair[0] / "model.safetensors"), "pt") as f:
        fp8 = {n for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"}
        names = set(f.keys())
    linear = (
        "model.layers.1.linear_attn."
        if "model.layers.1.linear_attn.A_log" in names
        else "model.layers.0.linear_attn."
    )
    assert {linear + "in_proj_qkv.weight", linear + "in_proj_z.weight", linear + "out_proj.weight"} <= fp8
    assert not {linear + p for p in ("in_proj_a.weight", "in_proj_b.weight", "conv1d.weight")} & fp8
    assert not {n for n in fp8 if ".mlp.gate." in n or "shared_expert_gate" in n or "lm_head" in n}
    assert {n + "_scale_inv" for n in fp8} <= names


def test_resident_fp8_checkpoint_matches_dequantized_reference(fp8_pair: tuple[Path, Path]) -> None:
    fp8_dir, deq_dir = fp8_pair
    resident, config = load(fp8_dir, quantization="fp8")
    reference, ref_config = load(deq_dir)
    assert config.quantization.resident and config.quantization.from_checkpoint
    ref = dict(reference.named_parameters())
    params = dict(resident.named_parameters())
    quantized = fp8_params(resident)
    assert set(quantized) == expected_fp8(list(ref)) and quantized
    for name, weight in quantized.items():
        deq = dequantize_blocks(weight, params[name + "_scale_inv"], BLOCK)
        if name.endswith(".in_proj.weight"):  # q/k/v/z in FP8, b/a (the last rows) as the checkpoint has them
            tail = params[name.removesuffix("weight") + "weight_tail"]
            assert tail.dtype == torch.float32 and tail.shape[0] == ref[name].shape[0] - weight.shape[0]
            deq = torch.cat([deq, tail])
        assert torch.equal(deq, ref[name]), name
    assert_same_run(run_greedy(resident, config), run_greedy(reference, ref_config))


def test_published_blocks_load_dequantized_where_shards_are_off_the_blocks(
    plain: Path, tmp_path: Path
) -> None:
    """128x128 blocks on the tiny shapes: in_proj_qkv's k and v start mid-block, so the default CPU path
    (dequantized at load) reads in_proj_qkv whole; it equals the dequantized checkpoint."""
    fp8_dir, deq_dir = write_fp8_pair(plain, tmp_path, (128, 128))
    ours, config = load(fp8_dir)
    assert not config.quantization.resident
    reference, ref_config = load(deq_dir)
    ref = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, ref[name]), name
    assert_same_run(run_greedy(ours, config), run_greedy(reference, ref_config))


def test_quantization_fp8_matches_quantize_then_dequantize(plain: Path) -> None:
    """`--quantization fp8` (128x128 blocks over this rank's fused matrices): each FP8 weight is the naive
    quantizer's values and scales, the Gated DeltaNet's b/a rows stay unquantized, and the model runs like
    the float32 one holding those weights dequantized."""
    ours, config = load(plain, quantization="fp8")
    reference, ref_config = load(plain)
    ref_params = dict(reference.named_parameters())
    params = dict(ours.named_parameters())
    quantized = fp8_params(ours)
    assert set(quantized) == expected_fp8(list(ref_params)) and quantized
    for name, weight in quantized.items():
        original = ref_params[name].detach().clone()
        values, scale = naive_fp8(original[: weight.shape[0]], (128, 128))
        assert torch.equal(weight.float(), values.float()), name
        assert torch.equal(params[name + "_scale_inv"], scale), name
        deq = dequantize_blocks(values, scale, (128, 128))
        if name.endswith(".in_proj.weight"):
            tail = params[name.removesuffix("weight") + "weight_tail"]
            assert torch.equal(tail, original[weight.shape[0] :]), name
            deq = torch.cat([deq, tail])
        with torch.no_grad():
            ref_params[name].copy_(deq)
    assert_same_run(run_greedy(ours, config), run_greedy(reference, ref_config))


def test_engine_serves_the_fp8_checkpoint_like_its_dequantized_copy(fp8_pair: tuple[Path, Path]) -> None:
    """Engine(quantization='fp8', dtype='float32') on the FP8 checkpoint vs the Engine on the dequantized
    copy: the same greedy tokens and prompt log-probs (float32; only the order of sums differs)."""
    size, tokens, logprobs = engine_run(fp8_pair[0], dtype="float32", quantization="fp8")
    ref_size, ref_tokens, ref_logprobs = engine_run(fp8_pair[1], dtype="float32")
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, rel=1e-5, abs=1e-6)
    assert size < ref_size


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bench_builds_the_published_layout_layer_by_layer(kind: str, tmp_path: Path) -> None:
    """bench/qwen35_fp8_build.py: the same tensor names as transformers saves for the config (experts per
    expert), FP8 exactly where tests/fp8_helpers.py's published layout puts it, float32 block scales, one
    shard per layer; it loads resident like the same checkpoint dequantized at load."""
    from safetensors import safe_open
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    from bench.qwen35_fp8_build import write_fp8_checkpoint
    from tests.fp8_helpers import is_quantized

    config = tiny_qwen3_5_config() if kind == "dense" else tiny_qwen3_5_moe_config()
    model_class = Qwen3_5ForCausalLM if kind == "dense" else Qwen3_5MoeForCausalLM
    path = write_fp8_checkpoint(tmp_path / "fp8", model_class, config, BLOCK, "cpu")
    saved = write_checkpoint(tmp_path / "hf", config)
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    dtypes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            dtypes.update({n: f.get_slice(n).get_dtype() for n in f.keys()})
    assert len(list(path.glob("*.safetensors"))) == config.num_hidden_layers + 1
    assert {n for n in dtypes if not n.endswith("_scale_inv")} == hf_names
    assert {n for n, d in dtypes.items() if d == "F8_E4M3"} == {n for n in hf_names if is_quantized(n)}
    assert {n for n, d in dtypes.items() if d == "F32"} == {
        n + "_scale_inv" for n in hf_names if is_quantized(n)
    }
    resident, config_r = load(path, quantization="fp8")
    dequantized, config_d = load(path)
    assert set(fp8_params(resident)) == expected_fp8([n for n, _ in dequantized.named_parameters()])
    assert_same_run(run_greedy(resident, config_r), run_greedy(dequantized, config_d))
