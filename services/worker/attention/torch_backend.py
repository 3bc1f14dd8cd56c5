"""The `torch` attention backend: store the new K/V in the pool, then attend over each request's whole
sequence gathered through req_to_token. Runs anywhere (it is the CPU backend and the reference the GPU
kernels are checked against).

Decode (one query per request) is batched: every request's key slots are padded to the longest
sequence in the batch (padding reads slot 0 and is masked out), gathered per KV head, and each KV
head's group of query heads attends in one scaled_dot_product_attention call (on CPU a fused kernel:
in bfloat16 a fifth of the time of the two batched matmuls and softmax it replaced at batch 1, see
bench/RESULTS.md). All index and mask tensors are built once per step in `init_forward_metadata`, so
a layer costs a handful of tensor ops whatever the batch size.
Extend keeps a per-request SDPA loop: prefill is matmul-bound, and the loop keeps the causal
bookkeeping of mixed prefix lengths obvious.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.worker.attention.base import AttentionBackend
from services.worker.mem.memory_pool import TokenToKVPool

if TYPE_CHECKING:
    from services.worker.forward_batch import ForwardBatch
    from services.worker.layers.attention import RadixAttention

# The dense decode blocks (DenseKV, all layers, keys and values) may take at most this much memory;
# larger batches gather their keys from the pool at every step instead.
DENSE_KV_MAX_BYTES = 512 * 2**20
# Block capacity is the longest sequence rounded up to this, plus as much again: blocks are rebuilt
# (gathered from the pool) once per this many decode steps at most, not at every step.
DENSE_KV_HEADROOM = 64


@dataclass(frozen=True)
class ExtendMetadata:
    """Per request: its KV slots for positions 0..seq_len-1, the row of its first new token in the
    batch, its new-token count, and its causal mask (None for a single new token, which sees all)."""

    kv_slots: list[torch.Tensor]
    q_starts: list[int]
    q_lens: list[int]
    masks: list[torch.Tensor | None]


@dataclass(frozen=True)
class DecodeMetadata:
    """Where a decode step reads its keys: `slots` [bs, max_len] holds each request's KV slots
    (entries past a request's length read slot 0, the padding row); `mask` is True for real keys and
    False for padding, shaped [bs, 1, 1, max_len], None when every request has the same length.

    Exactly one way of reading is set: `first_slot` (a lone request whose keys sit in consecutive
    slots, the usual case for one request on a fresh pool: attention reads the pool through a view),
    `dense` (the batch's keys kept in dense blocks across steps, see DenseKV), or `head_rows` (the
    keys gathered from the pool every layer: row (b * kv_heads + h) * max_len + i of the gather reads
    KV head h of request b's slot at position i, the pool viewed as [slots * kv_heads, head_dim])."""

    slots: torch.Tensor
    max_len: int
    mask: torch.Tensor | None
    first_slot: int | None = None
    head_rows: torch.Tensor | None = None
    dense: DenseKV | None = None
    # With `dense`: the slots [bs * capacity] to gather into the blocks at this step (they were just
    # (re)built; padding reads slot 0), or None when the blocks already hold every earlier token and
    # only this step's go in, at rows `dense_new_rows` [bs] of the blocks viewed as [bs * capacity, ...].
    dense_fill_slots: torch.Tensor | None = None
    dense_new_rows: torch.Tensor | None = None


class DenseKV:
    """The running decode batch's keys and values, per layer in dense blocks [bs, capacity, kv_heads,
    head_dim] (request b's K or V at position i in [b, i], laid out as a pool slot), kept from one
    decode step to the next.

    A decode batch's slots are not consecutive (every step allocates one slot per request, so the
    requests' tokens interleave in the pool), so reading the pool means gathering every key of every
    layer at every step: at 16 requests of ~130 tokens that was ~7 ms of a ~50 ms bfloat16 step on a
    2-core machine, random reads of the whole live KV plus a copy of it. While the same requests keep
    decoding, the blocks need only each step's new key and value; they are rebuilt (gathered once)
    when the batch changes or outgrows the capacity. The pool stays the source of truth: every step
    still stores its K/V there."""

    def __init__(self, pool: TokenToKVPool, batch_size: int, capacity: int) -> None:
        self.pool = pool
        self.capacity = capacity
        shape = (batch_size, pool.num_kv_heads, capacity, pool.head_dim)
        self.keys = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        self.values = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        # What the blocks hold after the last step: its request rows, lengths and slots (None: nothing
        # valid, the next step rebuilds them).
        self.rows: list[int] | None = None
        self.seq_lens: list[int] = []
        self.slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def holds_all_but_the_new_tokens(self, rows: list[int], seq_lens: list[int], slots: torch.Tensor) -> bool:
        """Whether the blocks hold every key of this step but its new ones: the same requests in the
        same order, each one token longer than at the last step, whose earlier positions still map to
        the same slots (nothing writes a slot between two decode steps unless it was freed and taken
        again; the caller ensures no other forward ran in between)."""
        if self.rows != rows or self.slots is None or max(seq_lens) > self.capacity:
            return False
        if any(new != old + 1 for new, old in zip(seq_lens, self.seq_lens)):
            return False
        old = self.slots
        earlier = slots[:, : old.shape[1]]
        if min(self.seq_lens) != old.shape[1]:
            key_pos = torch.arange(old.shape[1], device=slots.device)
            old_lens = torch.tensor(self.seq_lens, device=slots.device)
            earlier = earlier.masked_fill(key_pos[None, :] >= old_lens[:, None], 0)
        return torch.equal(earlier, old)


def _head_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[bs * kv_heads * len] rows of the pool viewed as [slots * kv_heads, head_dim]: KV head h of each
    request's slot at each position, in (request, head, position) order."""
    heads = torch.arange(kv_heads, device=slots.device)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


def _extend_metadata(batch: ForwardBatch) -> ExtendMetadata:
    table = batch.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices.tolist()
    kv_slots = [table[row, :seq_len].to(torch.int64) for row, seq_len in zip(rows, batch.seq_lens_cpu)]
    q_lens = list(batch.extend_seq_lens_cpu)
    q_starts = [0] * len(q_lens)
    for i in range(1, len(q_lens)):
        q_starts[i] = q_starts[i - 1] + q_lens[i - 1]
    device = batch.input_ids.device
    masks: list[torch.Tensor | None] = []
    for seq_len, prefix, q_len in zip(batch.seq_lens_cpu, batch.extend_prefix_lens_cpu, q_lens):
        if q_len == 1:
            masks.append(None)
            continue
        # New token j sits at position prefix + j and sees keys 0 .. prefix + j.
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(prefix, prefix + q_len, device=device)
        masks.append(key_pos[None, :] <= query_pos[:, None])
    return ExtendMetadata(kv_slots, q_starts, q_lens, masks)


def _decode_metadata(batch: ForwardBatch) -> DecodeMetadata:
    """The step's slots and mask, read through a view for a lone request with consecutive slots and
    gathered from the pool otherwise (the backend may switch the latter to its dense blocks)."""
    seq_lens = batch.seq_lens_cpu
    max_len = max(seq_lens)
    table = batch.req_to_token_pool.req_to_token
    slots = table.index_select(0, batch.req_pool_indices)[:, :max_len].to(torch.int64)
    mask = None
    if min(seq_lens) != max_len:
        key_pos = torch.arange(max_len, device=slots.device)
        real = key_pos[None, :] < batch.seq_lens[:, None]
        # Entries past a request's length may hold stale slots: read the padding row instead.
        slots = slots.masked_fill(~real, 0)
        mask = real[:, None, None, :]
    if len(seq_lens) == 1:
        first = int(slots[0, 0])
        if int(slots[0, -1]) - first == max_len - 1 and torch.equal(
            slots[0], torch.arange(first, first + max_len, device=slots.device)
        ):
            return DecodeMetadata(slots, max_len, mask, first_slot=first)
    kv_heads = batch.token_to_kv_pool.num_kv_heads
    return DecodeMetadata(slots, max_len, mask, head_rows=_head_rows(slots, kv_heads))


class TorchAttnBackend(AttentionBackend):
    """SDPA over the whole batch for decode (dense blocks kept across steps, a view, or a gather),
    per-request SDPA for extend."""

    def __init__(self) -> None:
        # The dense K/V blocks of the last decode step, if it used them (any other step drops them).
        self._dense: DenseKV | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            batch.attn_metadata = self._use_dense(batch, _decode_metadata(batch))
        else:
            self._dense = None
            batch.attn_metadata = _extend_metadata(batch)

    def _use_dense(self, batch: ForwardBatch, meta: DecodeMetadata) -> DecodeMetadata:
        """`meta` switched to dense blocks when the batch takes them: several requests (a lone one
        reads through a view or, scattered, gathers about as cheaply), each in one row (speculative
        verification sends one row per token of a request) and blocks within DENSE_KV_MAX_BYTES."""
        rows = batch.req_pool_indices.tolist()
        pool = batch.token_to_kv_pool
        bs = len(rows)
        capacity = (meta.max_len // DENSE_KV_HEADROOM + 2) * DENSE_KV_HEADROOM
        per_token = TokenToKVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
        dense = self._dense
        self._dense = None
        if meta.first_slot is not None or bs < 2 or len(set(rows)) != bs or bs * capacity * per_token > DENSE_KV_MAX_BYTES:
            return meta
        seq_lens = list(batch.seq_lens_cpu)
        kv_heads = pool.num_kv_heads
        if dense is not None and dense.pool is pool and dense.holds_all_but_the_new_tokens(rows, seq_lens, meta.slots):
            # Request b's new token (position seq_len - 1) goes to row (b * kv_heads + h) * capacity
            # + seq_len - 1 of each block viewed as [bs * kv_heads * capacity, head_dim].
            bh = torch.arange(bs * kv_heads, device=meta.slots.device).view(bs, kv_heads)
            new_rows = (bh * dense.capacity + (batch.seq_lens - 1)[:, None]).reshape(-1)
            fill_rows = None
        else:
            if dense is None or dense.pool is not pool or dense.batch_size != bs or dense.capacity < meta.max_len:
                dense = None  # the old blocks go before the new ones are allocated
                dense = DenseKV(pool, bs, capacity)
            padded = torch.zeros((bs, dense.capacity), dtype=meta.slots.dtype, device=meta.slots.device)
            padded[:, : meta.max_len] = meta.slots
            new_rows, fill_rows = None, _head_rows(padded, kv_heads)
        dense.rows, dense.seq_lens, dense.slots = rows, seq_lens, meta.slots
        self._dense = dense
        return replace(meta, head_rows=None, dense=dense, dense_fill_slots=fill_rows, dense_new_rows=new_rows)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if not isinstance(batch.attn_metadata, ExtendMetadata):
            self.init_forward_metadata(batch)
        meta: ExtendMetadata = batch.attn_metadata  # type: ignore[assignment]
        k_buffer = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        gqa = layer.num_heads != layer.num_kv_heads
        for slots, start, q_len, mask in zip(meta.kv_slots, meta.q_starts, meta.q_lens, meta.masks):
            qi = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
            ki = k_buffer[slots].to(q.dtype).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            vi = v_buffer[slots].to(q.dtype).transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=gqa
            )
            out[start : start + q_len] = oi.transpose(0, 1)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if not isinstance(batch.attn_metadata, DecodeMetadata):
            self.init_forward_metadata(batch)
        meta: DecodeMetadata = batch.attn_metadata  # type: ignore[assignment]
        bs, kv_heads, head_dim = batch.batch_size, layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kv_heads
        # Query head h * group + j attends with KV head h (HF's repeat_interleave order): the group's
        # queries are the "query positions" of KV head h.
        qg = q.reshape(bs, kv_heads, group, head_dim)
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if meta.dense is not None:
            keys, values = meta.dense.keys[layer.layer_id], meta.dense.values[layer.layer_id]
            if meta.dense_fill_slots is not None:
                torch.index_select(k_buffer.view(-1, head_dim), 0, meta.dense_fill_slots, out=keys.view(-1, head_dim))
                torch.index_select(v_buffer.view(-1, head_dim), 0, meta.dense_fill_slots, out=values.view(-1, head_dim))
            else:
                assert meta.dense_new_rows is not None
                keys.view(-1, head_dim).index_copy_(0, meta.dense_new_rows, k.reshape(-1, head_dim).to(keys.dtype))
                values.view(-1, head_dim).index_copy_(0, meta.dense_new_rows, v.reshape(-1, head_dim).to(values.dtype))
            keys = keys[:, :, : meta.max_len].to(q.dtype)
            values = values[:, :, : meta.max_len].to(q.dtype)
        elif meta.first_slot is not None:
            span = slice(meta.first_slot, meta.first_slot + meta.max_len)
            # [max_len, kv_heads, head_dim] slots -> [1, kv_heads, max_len, head_dim], a strided view.
            keys = k_buffer[span].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
            values = v_buffer[span].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
        else:
            assert meta.head_rows is not None
            keys = k_buffer.view(-1, head_dim).index_select(0, meta.head_rows)
            values = v_buffer.view(-1, head_dim).index_select(0, meta.head_rows)
            keys = keys.view(bs, kv_heads, meta.max_len, head_dim).to(q.dtype)
            values = values.view(bs, kv_heads, meta.max_len, head_dim).to(q.dtype)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.mask, scale=layer.scaling)
        return out.reshape(bs, layer.num_heads * head_dim)

