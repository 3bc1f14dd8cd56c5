"""Block-wise FP8 checkpoints as published (layers/fp8.py): a tiny seeded Qwen3 / Qwen3-MoE checkpoint is
block-quantized to float8_e4m3fn with weight_scale_inv tensors and transformers' FineGrainedFP8
quantization_config, the way the official "-FP8" checkpoints are stored. The reference is the plain
checkpoint whose weights are replaced by the dequantized values (fp8 * scale_inv, float32): loading the
FP8 one must give exactly its parameters, tokens and log-probs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.frontend.engine import Engine
from services.worker.runtime.layers.fp8 import (
    Fp8BlockWeight,
    dequantize_blocks,
    dequantize_fp8_weights,
    parse_quantization_config,
)
from services.worker.runtime.layers.linear import narrow_weight
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.engine_helpers import GREEDY, hf_greedy, random_prompts
from tests.fp8_helpers import QUANT, quantize_blocks, write_fp8_pair


@pytest.fixture(scope="module")
def fp8_qwen3(qwen3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_fp8_pair(qwen3_path, tmp_path_factory.mktemp("fp8_qwen3"), (16, 16))


@pytest.fixture(scope="module")
def fp8_qwen3_moe(qwen3_moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_fp8_pair(qwen3_moe_path, tmp_path_factory.mktemp("fp8_qwen3_moe"), (16, 16))


def load_params(path: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(ModelConfig.from_path(path, dtype="float32"), "cpu").named_parameters())


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("block", [(16, 16), (24, 40)], ids=["whole_blocks", "partial_edge_blocks"])
def test_fp8_checkpoint_loads_its_dequantized_weights(
    request: pytest.FixtureRequest, tmp_path: Path, model: str, block: tuple[int, int]
) -> None:
    """Every parameter equals the dequantized checkpoint's (experts included: layers/moe.py's loader);
    with (24, 40) blocks the 64/32/128-wide matrices end in partial blocks."""
    original = request.getfixturevalue(f"{model}_path")
    fp8_dir, deq_dir = write_fp8_pair(original, tmp_path, block)
    assert ModelConfig.from_path(fp8_dir).quantization.block_size == block
    ours, ref = load_params(fp8_dir), load_params(deq_dir)
    assert ours.keys() == ref.keys()
    assert any("experts" in name for name in ours) == (model == "qwen3_moe")
    for name, param in ours.items():
        assert torch.equal(param, ref[name]), name
    changed = {name for name, param in load_params(original).items() if not torch.equal(param, ours[name])}
    # Exactly the linear layers and experts were quantized; embeddings, norms, lm_head, router were not.
    assert changed == {name for name in ours if name.endswith(("_proj.weight", ".w13_weight", ".w2_weight"))}


def test_scales_in_another_shard_file_than_their_weights(
    fp8_qwen3: tuple[Path, Path], tmp_path: Path
) -> None:
    """A sharded checkpoint (index + files) whose scales sit in a different file from their weights."""
    fp8_dir, deq_dir = fp8_qwen3
    out = tmp_path / "sharded"
    shutil.copytree(fp8_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    files = {"a.safetensors": {}, "b.safetensors": {}}
    for name, tensor in tensors.items():
        files["b.safetensors" if name.endswith("_scale_inv") else "a.safetensors"][name] = tensor
    for file, part in files.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
    weight_map = {name: file for file, part in files.items() for name in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ours, ref = load_params(out), load_params(deq_dir)
    assert all(torch.equal(param, ref[name]) for name, param in ours.items())


def prompt_logprobs(path: Path, prompts: list[list[int]], **engine_kwargs: object) -> tuple[list, list]:
    """(16 greedy tokens per prompt, the prompt's teacher-forced log-probs per prompt)."""
    with Engine(str(path), **engine_kwargs) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
        scored = engine.generate(
            input_ids=prompts,
            sampling_params={**GREEDY, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
    logprobs = [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] for out in scored]
    return [out["output_ids"] for out in greedy], logprobs


# FP8 e4m3 keeps 3 mantissa bits (relative rounding error up to 1/16 per weight). On these tiny random
# models (prompt log-probs around -7) the prompt log-probs moved from the unquantized ones by 0.14-0.15
# nats on average and 0.49 (Qwen3) / 0.76 (Qwen3-MoE) at most.
MAX_LOGPROB_DIFF = 1.0
MEAN_LOGPROB_DIFF = 0.25


@pytest.mark.parametrize("fixture", ["fp8_qwen3", "fp8_qwen3_moe"])
def test_engine_on_fp8_equals_dequantized_and_is_close_to_original(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    fp8_dir, deq_dir = request.getfixturevalue(fixture)
    original = request.getfixturevalue(fixture.removeprefix("fp8_") + "_path")
    prompts = random_prompts(3, 6, 20, seed=11)
    tokens, logprobs = prompt_logprobs(fp8_dir, prompts)
    ref_tokens, ref_logprobs = prompt_logprobs(deq_dir, prompts)
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs  # exact: the same float32 weights
    assert tokens[0] == hf_greedy(deq_dir, prompts[0], 16)
    _, orig_logprobs = prompt_logprobs(original, prompts)
    diffs = [abs(a - b) for ours, orig in zip(logprobs, orig_logprobs) for a, b in zip(ours, orig)]
    assert 0 < max(diffs) < MAX_LOGPROB_DIFF
    assert sum(diffs) / len(diffs) < MEAN_LOGPROB_DIFF


@pytest.mark.parametrize("fixture", ["fp8_qwen3", "fp8_qwen3_moe"])
def test_engine_on_fp8_matches_transformers_fp8_loading(request: pytest.FixtureRequest, fixture: str) -> None:
    """transformers' own FineGrainedFP8 loading with dequantize=True (its CPU path) as a second reference:
    same greedy tokens, prompt log-probs within 1e-4. transformers requires accelerate to load any FP8
    checkpoint, and accelerate is not one of our dependencies, so this runs where it is installed."""
    pytest.importorskip(
        "accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed"
    )
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    fp8_dir = request.getfixturevalue(fixture)[0]
    hf = AutoModelForCausalLM.from_pretrained(
        str(fp8_dir),
        dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(weight_block_size=(16, 16), dequantize=True),
    ).eval()
    prompts = random_prompts(2, 6, 20, seed=12)
    tokens, logprobs = prompt_logprobs(fp8_dir, prompts)
    for prompt, got, lps in zip(prompts, tokens, logprobs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            ref_lp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        assert got == ref
        expected = [ref_lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert lps == pytest.approx(expected, abs=1e-4)


def test_tensor_parallel_2_on_fp8_moe_matches_1(fp8_qwen3_moe: tuple[Path, Path]) -> None:
    """TP=2 (gloo): each rank's column/row/expert slices start on 16-row blocks and read their scales."""
    prompts = random_prompts(3, 5, 20, seed=7)
    params = {**GREEDY, "max_new_tokens": 12}
    with Engine(str(fp8_qwen3_moe[0]), tp_size=2) as engine:
        tp2 = [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=params)]
    assert tp2 == [hf_greedy(fp8_qwen3_moe[1], prompt, 12) for prompt in prompts]


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "awq"}, "quant_method='awq' is not supported"),
        ({**QUANT, "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2' is not supported"),
        (
            {**QUANT, "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme='static'",
        ),
        (QUANT, "per-tensor FP8 checkpoints are not supported"),
        ({**QUANT, "weight_block_size": [128]}, "must be two positive integers"),
    ],
)
def test_unsupported_quantization_configs_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(config)


def test_bad_fp8_checkpoints_are_refused(fp8_qwen3: tuple[Path, Path], tmp_path: Path) -> None:
    fp8_dir = fp8_qwen3[0]
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"

    def load_with(changed: dict[str, torch.Tensor], block: list[int] | None = None) -> None:
        out = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fp8_dir, out)
        save_file(changed, str(out / "model.safetensors"), metadata={"format": "pt"})
        if block is not None:
            config = json.loads((out / "config.json").read_text())
            config["quantization_config"]["weight_block_size"] = block
            (out / "config.json").write_text(json.dumps(config))
        load_params(out)

    with pytest.raises(ValueError, match=f"{name}' is torch.float8_e4m3fn but has no .*weight_scale_inv"):
        load_with({k: v for k, v in tensors.items() if k != name + "_scale_inv"})
    with pytest.raises(ValueError, match="do not match its quantization_config.weight_block_size"):
        load_with(tensors, block=[32, 32])
    with pytest.raises(ValueError, match="weight_scale_inv tensors without their weights"):
        load_with({**tensors, "model.layers.0.mlp.extra_proj.weight_scale_inv": torch.ones(1, 1)})


def test_a_split_off_the_block_boundaries_is_refused() -> None:
    """What a TP rank's loader asks for: rows 32.. of a 64-row weight in 24-row blocks starts mid-block."""
    weight, scale = quantize_blocks(torch.randn(64, 48), (24, 16))
    lazy = Fp8BlockWeight("w.weight", weight, scale, (24, 16))
    with pytest.raises(
        ValueError, match=r"rows/columns \[32, 64\) of dim 0 .* do not align with weight_block_size 24"
    ):
        narrow_weight(lazy, 0, 32, 32)
    # Slices on block boundaries (and one ending at the tensor's end, mid-block) dequantize those blocks.
    full = dequantize_blocks(weight, scale, (24, 16))
    assert torch.equal(narrow_weight(lazy, 0, 24, 40), full[24:])
    assert torch.equal(narrow_weight(lazy, 1, 16, 16), full[:, 16:32])
    plain = torch.randn(4, 4)
    assert list(
        dequantize_fp8_weights(
            [("a.weight", plain)], {}, parse_quantization_config({**QUANT, "weight_block_size": [16, 16]})
        )
    ) == [("a.weight", plain)]
