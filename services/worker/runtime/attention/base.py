"""The attention-backend interface: models call `RadixAttention`, which calls the backend.

A backend owns nothing but metadata: KV lives in the TokenToKVPool. Each step the model runner calls
`init_forward_metadata(batch)` once; every attention layer then calls `forward`, which stores the
new tokens' K and V into the pool at `batch.out_cache_loc` and attends over each request's whole
sequence (cached prefix + new tokens, causally).

Models hand over q and k before their rotary embedding (and Qwen3's per-head q/k norm), through
`forward_with_rope`: by default that prologue runs layer by layer and then `forward`, but a backend may
fuse it with its own KV store (the triton backend does it all in one kernel launch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.layers.rotary import RotaryEmbedding


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged (token-level) KV pool.

    decode_rows_share_requests: a decode batch may hold several rows of one request (speculative
    verification and a draft's catch-up, ScheduleBatch.prepare_rows), row j attending to the new tokens
    of rows 0 .. j-1. Every row's K/V must then be stored before any row attends, so a backend may not
    fold the KV store into its decode attention launch. The model runner sets it before any graph is
    captured."""

    decode_rows_share_requests: bool = False

    def min_extend_chunk_tokens(self) -> int:
        """New tokens of one request below which its extend attention gets no faster: the scheduler
        does not cut a mixed step's chunk shorter than this (1: no such floor)."""
        return 1

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute whatever the kernels need for this step (index tensors, splits)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim].
        Returns [num_tokens, num_heads * head_dim]."""
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    def forward_with_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`forward` for q and k as the QKV projection gives them: each head of q and k is first
        RMS-normalized by q_norm / k_norm (Qwen3; None skips it), then rotated at `positions`. Here
        step by step with the layers' own modules; backends may override this to fuse the prologue
        with their KV store."""
        if rotary_emb.norm_rope_in_place(positions, q, k, q_norm, k_norm):  # the CPU's one op, float32 or bf16
            return self.forward(q, k, v, layer, batch)
        if q_norm is not None:
            q = q_norm(q.reshape(-1, layer.head_dim)).view(q.shape)
        if k_norm is not None:
            k = k_norm(k.reshape(-1, layer.head_dim)).view(k.shape)
        q, k = rotary_emb(positions, q, k)
        return self.forward(q, k, v, layer, batch)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """New tokens attend to their cached prefix plus themselves, causally."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """One new token per request attends to the request's whole sequence."""
