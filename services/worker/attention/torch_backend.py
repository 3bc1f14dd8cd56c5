"""The `torch` attention backend: store the new K/V in the pool, then for each request gather its
whole sequence's K/V through req_to_token and run torch SDPA. Runs anywhere (it is the CPU backend and
the reference the GPU kernels are checked against); the per-request loop is the price of simplicity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.worker.attention.base import AttentionBackend

if TYPE_CHECKING:
    from services.worker.forward_batch import ForwardBatch
    from services.worker.layers.attention import RadixAttention


@dataclass(frozen=True)
class TorchAttnMetadata:
    """Per request: its KV slots for positions 0..seq_len-1, the row of its first new token in the
    batch, its new-token count and its cached-prefix length."""

    kv_slots: list[torch.Tensor]
    q_starts: list[int]
    q_lens: list[int]
    prefix_lens: list[int]


class TorchAttnBackend(AttentionBackend):
    """SDPA over gathered KV, one request at a time."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        kv_slots = [table[row, :seq_len].to(torch.int64) for row, seq_len in zip(rows, batch.seq_lens_cpu)]
        q_lens = list(batch.extend_seq_lens_cpu)
        q_starts = [0] * len(q_lens)
        for i in range(1, len(q_lens)):
            q_starts[i] = q_starts[i - 1] + q_lens[i - 1]
        batch.attn_metadata = TorchAttnMetadata(
            kv_slots, q_starts, q_lens, list(batch.extend_prefix_lens_cpu)
        )

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        return self._attend(q, layer, batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        return self._attend(q, layer, batch)

    def _attend(self, q: torch.Tensor, layer: RadixAttention, batch: ForwardBatch) -> torch.Tensor:
        if batch.attn_metadata is None:
            self.init_forward_metadata(batch)
        meta: TorchAttnMetadata = batch.attn_metadata
        k_buffer = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        gqa = layer.num_heads != layer.num_kv_heads
        for slots, start, q_len, prefix in zip(meta.kv_slots, meta.q_starts, meta.q_lens, meta.prefix_lens):
            qi = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
            ki = k_buffer[slots].to(q.dtype).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            vi = v_buffer[slots].to(q.dtype).transpose(0, 1)
            mask = None
            if q_len > 1:
                # New token j sits at position prefix + j and sees keys 0 .. prefix + j.
                key_pos = torch.arange(slots.numel(), device=q.device)
                query_pos = torch.arange(prefix, prefix + q_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=gqa
            )
            out[start : start + q_len] = oi.transpose(0, 1)
        return out.view(-1, layer.num_heads * layer.head_dim)
