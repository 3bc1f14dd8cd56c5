"""Qwen3.5-MoE: the Qwen3.5 hybrid layers with a sparse MoE block in every layer.

The block routes each token to its top-k experts (softmax, the kept weights renormalised) and adds a
shared expert (a SwiGLU MLP) scaled by sigmoid(shared_expert_gate(x)). Checkpoints store the experts
per expert (`experts.{e}.gate_proj/up_proj/down_proj`, as transformers saves them) or stacked
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); both load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.worker.runtime.layers.linear import LoadedWeight, ReplicatedLinear, full_weight
from services.worker.runtime.layers.moe import expert_weight_target
from services.worker.runtime.models.llama import LlamaMLP
from services.worker.runtime.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5Model
from services.worker.runtime.models.qwen3_moe import Qwen3MoeSparseMoeBlock

if TYPE_CHECKING:
    from services.worker.runtime.model_config import ModelConfig

_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


class Qwen3_5MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE's router and routed experts (the kept weights always renormalised), plus the gated
    shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, renormalize=True)
        hf = config.hf_config
        self.shared_expert = LlamaMLP(config.hidden_size, int(hf.shared_expert_intermediate_size), hf.hidden_act)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, shared_out = self.shared_expert_gate(hidden), self.shared_expert(hidden)
        if self.experts.tp_size == 1:
            # Added where the routed outputs are summed (on the GPU one launch for the sum over k, the
            # sigmoid, the product and the add); under TP after the routed all-reduce, as its own rows are.
            return self.experts(hidden, self.gate(hidden), shared=(shared_out, gate))
        return super().forward(hidden) + torch.sigmoid(gate) * shared_out


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def make_mlp(self, config: ModelConfig) -> nn.Module:
        return Qwen3_5MoeSparseMoeBlock(config)


class Qwen3_5MoeModel(Qwen3_5Model):
    layer_cls = Qwen3_5MoeDecoderLayer


def _unstack_experts(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """Stacked expert tensors as the per-expert names FusedMoE loads (gate rows precede up rows)."""
    for name, weight in weights:
        match = _STACKED_EXPERTS.search(name)
        if match is None:
            yield name, weight
            continue
        stacked = full_weight(weight)
        prefix = name[: match.start()] + ".experts"
        for e in range(stacked.shape[0]):
            if match.group(1) == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", stacked[e]
            else:
                gate, up = stacked[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE models; also serves `Qwen3_5MoeForConditionalGeneration` checkpoints' text model."""

    model_cls = Qwen3_5MoeModel  # type: ignore[assignment]

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        expert = expert_weight_target(name)
        if expert is None:
            return super().weight_target(name)
        param_name, expert_id, shard_id = expert
        return param_name.replace("model.language_model.", "model.", 1), (expert_id, shard_id)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(_unstack_experts(weights))
