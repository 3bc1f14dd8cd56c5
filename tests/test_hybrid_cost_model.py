"""The mixed-chunk cost model (schedule_policy.model_keys_per_token) of hybrid models: only the
full-attention layers read keys, every layer has linear FLOPs. Checked against the FLOPs counted from
transformers' own modules: 2 per weight of each decoder layer (matrices and the conv1d; the routed
experts' share of top-k of E), plus the delta rule's ~4 per state element per linear layer, over the
attention FLOPs per key of the attention layers. The same count on a plain Qwen3 gives its (unchanged)
dense value, which checks the counting itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.worker.runtime.model_config import ModelConfig
from services.worker.scheduler.schedule_policy import ATTENTION_SLOWDOWN, model_keys_per_token


def counted_keys_per_token(path: Path) -> float:
    """K from transformers' modules: FLOPs per token over attention FLOPs per key."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = model.config
    experts = int(getattr(hf, "num_experts", 0) or 0)
    top_k = int(getattr(hf, "num_experts_per_tok", 1))
    kinds = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    flops = 0.0
    for layer in model.model.layers:
        for name, param in layer.named_parameters():
            if param.dim() < 2:  # norms, A_log, dt_bias: no per-token product
                continue
            share = top_k / experts if ".experts." in name else 1.0
            flops += 2 * param.numel() * share
    num_linear = kinds.count("linear_attention")
    if num_linear:
        flops += num_linear * 4 * hf.linear_num_value_heads * hf.linear_key_head_dim * hf.linear_value_head_dim
    num_attention = kinds.count("full_attention")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return flops / (num_attention * 4 * hf.num_attention_heads * head_dim * ATTENTION_SLOWDOWN)


@pytest.mark.parametrize("fixture", ["qwen3_path", "qwen3_5_path", "qwen3_5_moe_path"])
def test_keys_per_token_matches_the_flops_counted_from_the_modules(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    ours = model_keys_per_token(ModelConfig.from_path(path, dtype="float32"))
    assert ours == pytest.approx(counted_keys_per_token(path), rel=1e-9)


def test_a_hybrid_model_pays_attention_in_its_attention_layers_only(qwen3_5_path: Path) -> None:
    """Half the layers attend: K is about twice what it would be were every layer attention."""
    mc = ModelConfig.from_path(qwen3_5_path, dtype="float32")
    assert mc.num_attention_layers == 2 and mc.num_layers == 4
    all_attention = dataclasses.replace(mc, layer_types=("full_attention",) * mc.num_layers)
    ratio = model_keys_per_token(mc) / model_keys_per_token(all_attention)
    assert 1.5 < ratio < 2.5
