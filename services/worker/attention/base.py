"""The attention-backend interface: models call `RadixAttention`, which calls the backend.

A backend owns nothing but metadata: KV lives in the TokenToKVPool. Each step the model runner calls
`init_forward_metadata(batch)` once; every attention layer then calls `forward`, which stores the
new tokens' K and V into the pool at `batch.out_cache_loc` and attends over each request's whole
sequence (cached prefix + new tokens, causally).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.forward_batch import ForwardBatch
    from services.worker.layers.attention import RadixAttention


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged (token-level) KV pool."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute whatever the kernels need for this step (index tensors, splits)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim].
        Returns [num_tokens, num_heads * head_dim]."""
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        """New tokens attend to their cached prefix plus themselves, causally."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        """One new token per request attends to the request's whole sequence."""
