"""Qwen3-MoE: Qwen3 attention with sparse mixture-of-experts MLPs.

Layer i is sparse unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; those layers keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.worker.runtime.layers.linear import ReplicatedLinear
from services.worker.runtime.layers.moe import FusedMoE, expert_weight_target
from services.worker.runtime.models.llama import LlamaMLP
from services.worker.runtime.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model

if TYPE_CHECKING:
    from services.worker.runtime.model_config import ModelConfig


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router (replicated) + experts (TP-split by intermediate dim). `renormalize` (rescale the kept
    top-k weights to sum to 1) defaults to the config's `norm_topk_prob`."""

    def __init__(self, config: ModelConfig, renormalize: bool | None = None) -> None:
        super().__init__()
        hf = config.hf_config
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported for MoE (only 'silu')")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=config.num_experts,
            top_k=int(hf.num_experts_per_tok),
            hidden_size=config.hidden_size,
            intermediate_size=int(hf.moe_intermediate_size),
            renormalize=bool(hf.norm_topk_prob) if renormalize is None else renormalize,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        hf = config.hf_config
        mlp_only = set(getattr(hf, "mlp_only_layers", None) or [])
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        if layer_id not in mlp_only and config.num_experts > 0 and (layer_id + 1) % step == 0:
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, hf.intermediate_size, hf.hidden_act)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B)."""

    model_cls = Qwen3MoeModel

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        expert = expert_weight_target(name)
        if expert is None:
            return super().weight_target(name)
        param_name, expert_id, shard_id = expert
        return param_name, (expert_id, shard_id)
