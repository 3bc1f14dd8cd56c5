"""Qwen3.5 (dense): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention
layers, each followed by a SwiGLU MLP; `layer_types` (from `full_attention_interval`, by default three
linear layers to one full one) says which mixer each layer has.

Norms are zero-centred (scale 1 + weight). Full-attention layers number their KV buffers among
themselves, linear layers their StatePool rows among themselves (mem/state_pool.py), so neither pool
holds anything for the other kind.

Checkpoints: `Qwen3_5ForCausalLM` (weights `model.*`) and the text model of
`Qwen3_5ForConditionalGeneration` (`model.language_model.*`; the vision tower `model.visual.*` and the
multi-token-prediction head `mtp.*` are not loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.worker.runtime.layers.embedding import VocabParallelEmbedding
from services.worker.runtime.layers.gated_attention import GatedAttention
from services.worker.runtime.layers.gated_delta_net import GatedDeltaNet
from services.worker.runtime.layers.layernorm import ZeroCenteredRMSNorm
from services.worker.runtime.layers.rotary import RotaryEmbedding, get_rope
from services.worker.runtime.models.llama import LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch
    from services.worker.runtime.model_config import ModelConfig

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


class Qwen3_5DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(.)); the mixer is `linear_attn` (GatedDeltaNet) or
    `self_attn` (GatedAttention), named as in the checkpoint."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf_config
        eps = float(hf.rms_norm_eps)
        kind = config.layer_types[layer_id]
        self.is_linear = kind == LINEAR_ATTENTION
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(hf, config.hidden_size, config.linear_layer_index(layer_id))
        else:
            self.self_attn = GatedAttention(
                config.hidden_size, config.num_attention_heads, config.num_kv_heads, config.head_dim, eps,
                config.attention_layer_index(layer_id), rotary_emb, bool(getattr(hf, "attention_bias", False)),
            )
        self.mlp = self.make_mlp(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)

    def make_mlp(self, config: ModelConfig) -> nn.Module:
        hf = config.hf_config
        return LlamaMLP(config.hidden_size, int(hf.intermediate_size), hf.hidden_act)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = mixer(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    """Embedding, the hybrid decoder layers (attention layers share one rotary table), final norm."""

    layer_cls: type[Qwen3_5DecoderLayer] = Qwen3_5DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        max_position = max(config.context_len, int(hf.max_position_embeddings))
        rotary_emb = get_rope(hf, config.head_dim, max_position)
        self.layers = nn.ModuleList(self.layer_cls(config, i, rotary_emb) for i in range(config.num_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, float(hf.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3.5 dense models; also serves `Qwen3_5ForConditionalGeneration` checkpoints' text model."""

    model_cls = Qwen3_5Model  # type: ignore[assignment]
    stacked_params: tuple[tuple[str, str, Any], ...] = (
        *LlamaForCausalLM.stacked_params,
        (".in_proj.", ".in_proj_qkv.", 0),
        (".in_proj.", ".in_proj_z.", 1),
        (".in_proj.", ".in_proj_b.", 2),
        (".in_proj.", ".in_proj_a.", 3),
        (".conv_weight", ".conv1d.weight", None),
    )
    # Checkpoint parts that are not the language model.
    skipped_prefixes = ("model.visual.", "mtp.", "model.mtp.")

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        name = name.replace("model.language_model.", "model.", 1)
        for param_part, ckpt_part, shard_id in self.stacked_params:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), (() if shard_id is None else (shard_id,))
        return name, ()

    def skip_weight(self, name: str) -> bool:
        return name.startswith(self.skipped_prefixes) or super().skip_weight(name)
