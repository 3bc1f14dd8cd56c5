"""Llama (and SmolLM2): the decoder-only skeleton Qwen3 and Qwen3-MoE extend.

Pre-norm decoder layers of attention (fused QKV, neox RoPE, GQA) and a SwiGLU MLP (fused gate_up),
with RMSNorm fused into the residual adds. Subclasses swap parts through class attributes and small
hooks: `LlamaAttention.q_norm` / `k_norm` (per-head norms before RoPE), `LlamaDecoderLayer.make_mlp`,
and the checkpoint-name mapping of `LlamaForCausalLM.weight_target`.

With pipeline parallelism (runtime/pipeline.py) each stage builds and loads only its layers (the others
are PPMissingLayer), the first stage the embedding, the last the final norm and the LM head (with tied
embeddings, the last stage keeps its own copy of the embedding as its head).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.worker.runtime.distributed import get_pp_group, get_tp_size
from services.worker.runtime.layers.activation import get_act_and_mul
from services.worker.runtime.layers.attention import RadixAttention
from services.worker.runtime.layers.cpu_layer_row import layer_row, row_decode_step
from services.worker.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.worker.runtime.layers.layernorm import RMSNorm
from services.worker.runtime.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    norm_then_linear,
)
from services.worker.runtime.layers.logits_processor import LogitsProcessor
from services.worker.runtime.layers.rotary import RotaryEmbedding, get_rope
from services.worker.runtime.pipeline import PPMissingLayer, ProxyTensors, stage_layers

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch
    from services.worker.runtime.model_config import ModelConfig


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)): gate_up column-parallel, down row-parallel, one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = get_act_and_mul(hidden_act)
        # At batch 1 the decoder layer's norm runs inside gate_up and the activation inside down.
        self.gate_up_proj.prologue, self.down_proj.prologue = "rmsnorm", "silu_and_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_and_mul(self.gate_up_proj(x), self.act_fn)

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), with the norm fused into gate_up where it can be."""
        gate_up, residual = norm_then_linear(norm, self.gate_up_proj, x, residual)
        return self.down_proj.forward_silu_and_mul(gate_up, self.act_fn), residual


class LlamaAttention(nn.Module):
    """Self-attention with this rank's share of the heads; o_proj all-reduces."""

    def __init__(
        self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, kv_layer: int | None = None
    ) -> None:
        """kv_layer: the layer's index in this stage's KV pool (default: layer_id, one stage)."""
        super().__init__()
        hf = config.hf_config
        bias = bool(getattr(hf, "attention_bias", False))
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_kv_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias
        )
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
            layer_id if kv_layer is None else kv_layer,
        )
        # Per-head RMSNorm of q and k before RoPE: none in Llama (Qwen3 sets both).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), batch)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention from the fused projection's output onwards (the decoder layer may fuse its norm
        into qkv_proj)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The backend applies the norms and RoPE (the triton one together with its KV store).
        out = self.attn.forward_with_rope(positions, q, k, v, batch, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); the residual stream is passed along unnormalised."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(
        self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, kv_layer: int | None = None
    ) -> None:
        super().__init__()
        eps = float(config.hf_config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, layer_id, rotary_emb, kv_layer)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn.qkv_proj.prologue = "rmsnorm"  # see norm_then_linear
        # A LlamaMLP (not a subclass's MoE block): layers/cpu_layer_row.py may run this layer as one op.
        self.plain_mlp = type(self.mlp) is LlamaMLP

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        hf = config.hf_config
        return LlamaMLP(
            config.hidden_size, hf.intermediate_size, hf.hidden_act, bool(getattr(hf, "mlp_bias", False))
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm goes with the projection after it (one launch for both at batch-1 decode).
        qkv, residual = norm_then_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn.attend(positions, qkv, batch)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers (sharing one rotary table) and the final norm; with pipeline stages,
    this stage's share of them (`start_layer` to `end_layer`)."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        pp = get_pp_group()
        self.pp_first, self.pp_last = pp.is_first, pp.is_last
        own = stage_layers(config.num_layers, pp.rank, pp.size)
        self.start_layer, self.end_layer = own.start, own.stop
        # The last stage of a tied model uses the embedding as its LM head.
        keep_embedding = pp.is_first or (pp.is_last and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if keep_embedding else None
        max_position = max(config.context_len, int(config.hf_config.max_position_embeddings))
        rotary_emb = get_rope(config.hf_config, config.head_dim, max_position)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, rotary_emb, i - own.start) if i in own else PPMissingLayer()
            for i in range(config.num_layers)
        )
        # This stage's layers, sliced once: slicing a ModuleList builds a new one, each forward.
        self._own_layers: tuple[nn.Module, ...] = tuple(self.layers[own.start : own.stop])
        self.norm = RMSNorm(config.hidden_size, float(config.hf_config.rms_norm_eps)) if pp.is_last else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, proxy: ProxyTensors | None = None
    ) -> torch.Tensor | ProxyTensors:
        """The final normed hidden states on the last stage; (hidden, residual) for the next stage on
        the others. `proxy`: what the previous stage sent (None on the first)."""
        if self.pp_first:
            assert self.embed_tokens is not None
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            assert proxy is not None, "a later pipeline stage runs on the previous stage's activations"
            hidden, residual = proxy
        # CPU decode: each plain layer as one C++ op (layers/cpu_layer_row.py), else as modules.
        step = row_decode_step(batch, hidden) if hidden.device.type == "cpu" else None
        for layer in self._own_layers:
            if step is not None and (out := layer_row(layer, hidden, residual, batch, step)) is not None:
                hidden, residual = out
                continue
            hidden, residual = layer(positions, hidden, residual, batch)
        if self.norm is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """The model plus the (optionally tied) vocab-parallel LM head; returns float32 logits."""

    model_cls: type[LlamaModel] = LlamaModel
    # (parameter name part, checkpoint name part, shard id) for the fused projections.
    stacked_params: tuple[tuple[str, str, Any], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp_size = get_tp_size()
        self.pp_last = get_pp_group().is_last
        self.model = self.model_cls(config)
        self.lm_head: nn.Module | None = None
        if config.tie_word_embeddings and self.pp_last:
            self.lm_head = self.model.embed_tokens
        elif self.pp_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, proxy: ProxyTensors | None = None
    ) -> torch.Tensor | ProxyTensors:
        """float32 logits on the last pipeline stage; the activations for the next stage on the others."""
        hidden = self.model(input_ids, positions, batch) if proxy is None else self.model(input_ids, positions, batch, proxy)
        if not self.pp_last:
            return hidden
        return self.logits_processor(hidden, self.lm_head, batch)

    def weight_target(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """The parameter a checkpoint tensor loads into, and the shard arguments for its loader."""
        for param_part, ckpt_part, shard_id in self.stacked_params:
            if ckpt_part in name:
                return name.replace(ckpt_part, param_part), (shard_id,)
        return name, ()

    def skip_weight(self, name: str) -> bool:
        # Old checkpoints store the rotary table; tied checkpoints may still carry lm_head.
        return (
            "rotary_emb.inv_freq" in name
            or (self.config.tie_word_embeddings and name == "lm_head.weight")
            or self.other_stage_weight(name)
        )

    def other_stage_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to another pipeline stage (never with one stage)."""
        model = self.model
        if not isinstance(model, LlamaModel):
            return False
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            return not model.start_layer <= int(layer[1]) < model.end_layer
        if name.startswith("model.embed_tokens."):
            return model.embed_tokens is None
        if name.startswith("model.norm."):
            return model.norm is None
        if name.startswith("lm_head."):
            return self.lm_head is None
        return False

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters; returns the parameters set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, weight in weights:
            if self.skip_weight(ckpt_name):
                continue
            name, shard = self.weight_target(ckpt_name)
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} matches no parameter of {type(self).__name__}"
                )
            getattr(param, "weight_loader", default_weight_loader)(param, weight, *shard)
            loaded.add(name)
        return loaded
