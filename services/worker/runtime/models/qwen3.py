"""Qwen3: Llama's architecture plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.runtime.layers.layernorm import RMSNorm
from services.worker.runtime.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)

if TYPE_CHECKING:
    from services.worker.runtime.layers.rotary import RotaryEmbedding
    from services.worker.runtime.model_config import ModelConfig


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q_norm and k_norm (weights [head_dim], shared by all heads)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, kv_layer: int | None = None
    ) -> None:
        super().__init__(config, layer_id, rotary_emb, kv_layer)
        eps = float(config.hf_config.rms_norm_eps)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (Qwen3-0.6B ... Qwen3-32B)."""

    model_cls = Qwen3Model
