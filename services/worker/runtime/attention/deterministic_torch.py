"""The CPU attention backend of --enable-deterministic-inference: every query token, in a prefill, a chunk
or a decode step, attends to its keys by the same sequence of operations, so its output does not depend
on the batch, on how its prompt was chunked, or on whether it is being prefilled or decoded.

The `torch` backend is not batch-invariant: decode pads every request's keys to the batch's longest and
extend hands each request's queries to one scaled_dot_product_attention call, whose kernel picks its
query and key blocks (and so its summation order) from the lengths it is given.

Here a query at position p reads its keys 0..p from the pool in TILE_TOKENS-key tiles at fixed positions
(0, TILE_TOKENS, ...) and keeps an online softmax in float32, tile by tile in order, exactly as the Triton
kernels do. Each tile's products are elementwise and each sum runs over the last axis of a tensor whose
last axis has the same length (head_dim or TILE_TOKENS) whatever the batch: torch reduces every row of
such a tensor with the same loop, so a query's result depends only on its own q and keys. Queries are
taken QUERY_BLOCK at a time (that bounds the [queries, heads, tile, head_dim] products), and a tile only
visits the queries that have keys in it (the others would add exact zeros). The exponentials go through
layers/batch_invariant.py's `elementwise` (torch computes a tensor's last few elements another way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.layers.batch_invariant import elementwise

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch

TILE_TOKENS = 64
QUERY_BLOCK = 256


@dataclass(frozen=True)
class QueryRows:
    """The step's query tokens: each one's request row (of req_to_token) and key count (its position + 1),
    as int64 tensors and as host lists."""

    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]


def attend_queries(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: QueryRows,
    scale: float,
) -> torch.Tensor:
    """Attention of q [n, heads, head_dim] over each query's keys 0..seq_len-1 of its request, read from
    one layer's pool k_buffer / v_buffer [slots, kv_heads, head_dim] through req_to_token. Query head
    h uses KV head h // (heads / kv_heads). Returns [n, heads, head_dim] in q's dtype."""
    n, heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    group = heads // kv_heads
    width = req_to_token.shape[1]
    out = torch.empty_like(q)
    offsets = torch.arange(TILE_TOKENS, device=q.device)
    for b0 in range(0, n, QUERY_BLOCK):
        b1 = min(n, b0 + QUERY_BLOCK)
        qb = q[b0:b1].float().view(b1 - b0, kv_heads, group, 1, head_dim)
        lens = rows.seq_lens[b0:b1]
        req_rows = rows.req_rows[b0:b1]
        m = torch.full((b1 - b0, kv_heads, group), float("-inf"), device=q.device)
        denom = torch.zeros((b1 - b0, kv_heads, group), device=q.device)
        acc = torch.zeros((b1 - b0, kv_heads, group, head_dim), device=q.device)
        for t0 in range(0, max(rows.seq_lens_cpu[b0:b1]), TILE_TOKENS):
            idx = torch.nonzero(lens > t0).squeeze(1)
            pos = t0 + offsets
            valid = pos[None, :] < lens[idx, None]  # [na, tile]
            slots = req_to_token[req_rows[idx][:, None], pos.clamp(max=width - 1)[None, :]].to(torch.int64)
            slots = slots.masked_fill(~valid, 0)
            keys = k_buffer[slots].float().permute(0, 2, 1, 3).unsqueeze(2)  # [na, kv, 1, tile, d]
            scores = (qb[idx] * keys).sum(-1) * scale  # [na, kv, group, tile]
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
            m_old = m[idx]
            m_new = torch.maximum(m_old, scores.amax(-1))
            alpha = elementwise(torch.exp, m_old - m_new)
            p = elementwise(torch.exp, scores - m_new[..., None])
            values = v_buffer[slots].float().permute(0, 2, 3, 1).unsqueeze(2)  # [na, kv, 1, d, tile]
            pv = (p.unsqueeze(3) * values).sum(-1)  # [na, kv, group, d]
            m[idx] = m_new
            denom[idx] = denom[idx] * alpha + p.sum(-1)
            acc[idx] = acc[idx] * alpha[..., None] + pv
        out[b0:b1] = (acc / denom[..., None]).view(b1 - b0, heads, head_dim).to(q.dtype)
    return out


def query_rows(batch: ForwardBatch) -> QueryRows:
    """Each new token of the batch: its request's row and its key count (position + 1)."""
    if batch.forward_mode.is_decode():
        lens_cpu = list(batch.seq_lens_cpu)
        return QueryRows(batch.req_pool_indices.to(torch.int64), batch.seq_lens.to(torch.int64), lens_cpu)
    lens_cpu: list[int] = []
    for prefix, n in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
        lens_cpu.extend(range(prefix + 1, prefix + n + 1))
    device = batch.req_pool_indices.device
    counts = torch.tensor(list(batch.extend_seq_lens_cpu), dtype=torch.int64, device=device)
    req_rows = torch.repeat_interleave(batch.req_pool_indices.to(torch.int64), counts)
    return QueryRows(req_rows, torch.tensor(lens_cpu, dtype=torch.int64, device=device), lens_cpu)


class DeterministicTorchAttnBackend(AttentionBackend):
    """attend_queries for every step: decode, prefill, chunked prefill and mixed steps alike."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = query_rows(batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if not isinstance(batch.attn_metadata, QueryRows):
            self.init_forward_metadata(batch)
        rows: QueryRows = batch.attn_metadata  # type: ignore[assignment]
        out = attend_queries(
            q.reshape(-1, layer.num_heads, layer.head_dim),
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            batch.req_to_token_pool.req_to_token,
            rows,
            layer.scaling,
        )
        return out.view(-1, layer.num_heads * layer.head_dim)
