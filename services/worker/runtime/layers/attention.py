"""RadixAttention: the model-side attention layer. It holds no weights; it names its layer (which KV
buffer) and its per-rank head counts, and hands q/k/v to whichever backend the step uses.

Models pass q and k before RoPE (`forward_with_rope`), so the backend chooses how to apply it: the
triton backend fuses the per-head q/k norm, the rotation and the KV store into one launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.layers.rotary import RotaryEmbedding


class RadixAttention(nn.Module):
    """Attention over the paged KV pool; heads are this rank's counts."""

    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]."""
        return batch.attn_backend.forward(q, k, v, self, batch)

    def forward_with_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rotary_emb: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """`forward` on q and k straight from the QKV projection (views into its output are fine):
        RMSNorm over each head with q_norm / k_norm (Qwen3; None skips it), rotary_emb at positions,
        then attention. q and k may be rotated in place."""
        return batch.attn_backend.forward_with_rope(positions, q, k, v, rotary_emb, q_norm, k_norm, self, batch)

    def extra_repr(self) -> str:
        return f"layer={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
