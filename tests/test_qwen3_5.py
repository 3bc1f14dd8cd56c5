"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention layers, dense and MoE) on the torch backend
match HF transformers in float32 on CPU: prefill logits at every position, 32 greedy decode steps,
batched requests of different lengths, and prefills continued over a state carried between chunks.
Checkpoints: full attention first and last (dense), linear first and tied (dense), MoE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import (
    BatchDriver,
    assert_rows_close,
    check_greedy_decode,
    hf_logits,
    seeded_prompt,
)

DECODE_STEPS = 32


# The transformers references run single-threaded (tests/conftest.py's one_thread says why).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_5_path", "qwen3_5_tied_path", "qwen3_5_moe_path"])
def models(request: pytest.FixtureRequest) -> tuple[ModelConfig, torch.nn.Module, PreTrainedModel]:
    path: Path = request.getfixturevalue(request.param)
    config = ModelConfig.from_path(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, load_model(config, "cpu"), hf


def test_layer_kinds_come_from_the_checkpoint(models) -> None:
    config, model, hf = models
    assert config.is_hybrid and list(config.layer_types) == list(hf.config.layer_types)
    kinds = ["linear_attention" if layer.is_linear else "full_attention" for layer in model.model.layers]
    assert kinds == list(hf.config.layer_types)


def test_prefill_logits_match_hf_at_every_position(models) -> None:
    config, model, hf = models
    prompt = seeded_prompt(70, seed=1)  # longer than one 64-token chunk of the delta rule
    driver = BatchDriver(model, config)
    logits = driver.extend([(driver.new_request(), prompt)], return_all_logits=True)
    assert_rows_close(logits, hf_logits(hf, prompt))


def test_greedy_decode_matches_hf_generate_for_32_steps(models) -> None:
    config, model, hf = models
    check_greedy_decode(config, model, hf, seeded_prompt(20, seed=2), DECODE_STEPS)


def test_batched_requests_of_different_lengths_match_each_alone(models) -> None:
    config, model, hf = models
    prompts = [seeded_prompt(n, seed=10 + n) for n in (20, 3, 11)]
    driver = BatchDriver(model, config)
    rows = [driver.new_request() for _ in prompts]
    logits = driver.extend(list(zip(rows, prompts)), return_all_logits=True)
    assert_rows_close(logits, torch.cat([hf_logits(hf, p) for p in prompts]))
    nxt = logits[torch.tensor([20, 23, 34]) - 1].argmax(dim=-1).tolist()
    step = driver.decode(list(zip(rows, nxt)))
    for i, prompt in enumerate(prompts):
        assert_rows_close(step[i : i + 1], hf_logits(hf, prompt + [nxt[i]])[-1:])


def test_prefill_continued_in_chunks_beside_fresh_requests_matches_one_shot(models) -> None:
    """The conv and delta-rule state carried from chunk to chunk (and a 1-token chunk) give the
    one-shot prefill's logits; a fresh request in the same extend starts from zero state."""
    config, model, hf = models
    prompt, fresh = seeded_prompt(30, seed=3), seeded_prompt(6, seed=4)
    driver = BatchDriver(model, config)
    row, fresh_row = driver.new_request(), driver.new_request()
    parts = [driver.extend([(row, prompt[:2])], return_all_logits=True)]
    parts.append(driver.extend([(row, prompt[2:3])], return_all_logits=True))
    both = driver.extend([(row, prompt[3:]), (fresh_row, fresh)], return_all_logits=True)
    parts.append(both[: len(prompt) - 3])
    assert_rows_close(torch.cat(parts), hf_logits(hf, prompt))
    assert_rows_close(both[len(prompt) - 3 :], hf_logits(hf, fresh))


def test_freed_request_row_starts_its_next_request_from_zero_state(qwen3_5_path: Path) -> None:
    config = ModelConfig.from_path(qwen3_5_path, dtype="float32")
    model = load_model(config, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(qwen3_5_path, dtype=torch.float32).eval()
    driver = BatchDriver(model, config, max_requests=1)
    row = driver.new_request()
    driver.extend([(row, seeded_prompt(15, seed=5))])
    driver.req_pool.free(row)
    again = driver.new_request()
    assert again == row
    driver.seq_lens[again] = 0
    prompt = seeded_prompt(9, seed=6)
    # The KV of the first request is unreachable; its linear-layer state was zeroed when the row came back.
    assert_rows_close(driver.extend([(again, prompt)], return_all_logits=True), hf_logits(hf, prompt))


def multimodal_checkpoint(text_path: Path, out: Path, stacked_experts: bool = False) -> Path:
    """The checkpoint as Qwen3_5(Moe)ForConditionalGeneration saves its text model: config.json with a
    text_config, weights under model.language_model.*, a vision tower's tensor beside them, optionally
    the experts stacked [E, 2I, H] / [E, H, I]."""
    out.mkdir()
    text = json.loads((text_path / "config.json").read_text())
    moe = text["model_type"] == "qwen3_5_moe_text"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (out / "config.json").write_text(json.dumps(config))
    weights = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: w
        for name, w in load_file(text_path / "model.safetensors").items()
    }
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    if stacked_experts:
        for layer in range(text["num_hidden_layers"]):
            prefix = f"model.language_model.layers.{layer}.mlp.experts"
            experts = range(text["num_experts"])
            gate_up = [torch.cat([weights.pop(f"{prefix}.{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in experts]
            weights[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            weights[f"{prefix}.down_proj"] = torch.stack([weights.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize("which", ["dense", "moe_stacked_experts"])
def test_conditional_generation_checkpoint_serves_its_text_model(
    which: str, qwen3_5_path: Path, qwen3_5_moe_path: Path, tmp_path: Path
) -> None:
    text_path = qwen3_5_path if which == "dense" else qwen3_5_moe_path
    path = multimodal_checkpoint(text_path, tmp_path / "mm", stacked_experts=which != "dense")
    config = ModelConfig.from_path(path, dtype="float32")
    assert config.architecture.endswith("ForConditionalGeneration") and config.is_hybrid
    assert config.eos_token_ids == (2,)  # from the text_config: the outer config names none
    hf = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32).eval()
    prompt = seeded_prompt(12, seed=7)
    driver = BatchDriver(load_model(config, "cpu"), config)
    assert_rows_close(driver.extend([(driver.new_request(), prompt)], return_all_logits=True), hf_logits(hf, prompt))
