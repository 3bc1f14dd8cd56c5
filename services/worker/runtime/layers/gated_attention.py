"""Gated full attention (Qwen3.5's attention layers): Qwen3 attention whose q_proj also yields a
per-head output gate, with zero-centred q/k norms and partial rotary.

q_proj gives, per head, head_dim query features then head_dim gate features; the attention output is
multiplied by sigmoid(gate) before o_proj. q_norm / k_norm scale by (1 + weight). RoPE rotates only the
first rotary_dim = head_dim * partial_rotary_factor features of each head (rotary.py's table width).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.runtime.layers.attention import RadixAttention
from services.worker.runtime.layers.layernorm import ZeroCenteredRMSNorm
from services.worker.runtime.layers.linear import QKVParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch
    from services.worker.runtime.layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    """Self-attention with this rank's share of the heads; `kv_layer_id` is the layer's KV buffer (its
    index among the model's attention layers)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        kv_layer_id: int,
        rotary_emb: RotaryEmbedding,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # The query and gate halves of every head count as two "heads" of the fused projection, so a
        # checkpoint's q_proj [2 * heads * head_dim, hidden] loads as the 'q' shard unchanged.
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, 2 * num_heads, num_kv_heads, bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, kv_layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.reshape(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(tokens, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(tokens, self.kv_size)
        out = self.attn.forward_with_rope(positions, q, k, v.contiguous(), batch, self.rotary_emb)
        out = out * torch.sigmoid(gate.reshape(tokens, self.q_size))
        return self.o_proj(out)
