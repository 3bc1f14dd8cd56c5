"""The `torch` attention backend: store the new K/V in the pool, then attend over each request's whole
sequence read through req_to_token. Runs anywhere (it is the CPU backend and the reference the GPU
kernels are checked against).

Decode (one query per request) is batched: every request's keys are padded to the longest sequence in
the batch (padding is masked out) and each KV head's group of query heads attends in one
scaled_dot_product_attention call (on CPU a fused kernel: in bfloat16 a fifth of the time of the two
batched matmuls and softmax it replaced at batch 1, see bench/HISTORY.md). The keys come from dense
blocks kept across decode steps (attention/dense_kv.py: only each step's new K/V is copied in), from
a view of the pool for a lone request whose slots are consecutive, or else gathered from the pool per
KV head. That lone float32 (or bfloat16) request on the CPU skips SDPA: its ~70 us of dispatch a layer is more than the
work, so kernels/cpu/matvec.cpp's decode_attention_row attends instead (~6-16 us at 64-192 positions;
RS_CPU_ROW_ATTENTION=0 off). A float32 (or bfloat16) batch on the CPU skips SDPA too: decode_attention_rows attends per
request, reading each key and value row once, over the dense blocks (each request's rows one sequential run)
or the pool's slots (SmolLM2 at batch 16, ~120 positions, one thread: 196 us a layer against SDPA's 549 over
the same blocks, with the padding and mask it needs; the step 89 -> 74 ms). All index and mask tensors are built once per step in `init_forward_metadata`, so a layer
costs a handful of tensor ops whatever the batch size.
Extend keeps a per-request SDPA loop (the causal bookkeeping of mixed prefix lengths stays obvious), shaped
for torch's fused CPU kernel (flash attention for CPU): 4-D, the KV heads repeated to the query heads, and
`is_causal` for a prompt with no cached prefix (a boolean mask only when there is one). Given GQA heads
(`enable_gqa`) or 3-D tensors SDPA falls back to its unfused math path: on SmolLM2 that made attention
~16 % of a 256-token prompt pass, and the fused kernel takes a third to a half of that time.
A float8 pool (memory_pool.py) is read as stored, converted to the activation dtype; its K scale is
folded into the softmax scale and its V scale multiplies the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.attention.dense_kv import DenseKV, DenseStep

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch


@dataclass(frozen=True)
class ExtendMetadata:
    """Per request: its KV slots for positions 0..seq_len-1, the row of its first new token in the
    batch, its new-token count, and its causal mask: None for a single new token (it sees all keys) and
    for a prompt with no cached prefix (`is_causal` there, top-left aligned as its queries and keys are).
    Where `rows` is set, only q_lens and the fields after `rows` are (the C++ op takes the whole batch)."""

    kv_slots: list[torch.Tensor]
    q_starts: list[int]
    q_lens: list[int]
    masks: list[torch.Tensor | None]
    # Float32 on an AVX-512 or AVX2 CPU: kernels/cpu/extend_attention.cpp's op attends for the whole batch, reading
    # the pool through `slots` [bs, max seq_len] with `seq_lens` and `q_len_rows` (int64 [bs]).
    rows: Any = None
    slots: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    q_len_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeMetadata:
    """The batch's keys as one padded block [bs, max_len]: `slots` holds each request's KV slots
    (entries past its length read slot 0, the padding row); `mask` is True for real keys and False
    for padding, shaped [bs, 1, 1, max_len], None when every request has the same length.

    Exactly one way of reading them is set: `first_slot`, `dense`, `head_rows` or `rows` (with or without
    `dense`)."""

    slots: torch.Tensor  # [bs, max_len] int64
    max_len: int
    mask: torch.Tensor | None
    # A single request whose keys sit in consecutive slots (the usual case for one request on a
    # fresh pool: slots are handed out in order): its first slot. Attention then reads the pool
    # through a view instead of gathering 2 x layers copies of its K/V every step.
    first_slot: int | None = None
    # Several requests: the dense blocks (DenseKV) this step appends to, or fills.
    dense: DenseStep | None = None
    # Otherwise row (b * kv_heads + h) * max_len + i of the gather reads KV head h of request b's slot
    # at position i, the pool viewed as [slots * kv_heads, head_dim].
    head_rows: torch.Tensor | None = None  # [bs * kv_heads * max_len] int64
    # Several requests, float32 on the CPU: kernels/cpu/matvec.cpp's decode_attention_rows attends, over
    # the dense blocks through `row_slots` (request b's position i at row b * capacity + i of a block
    # viewed as [bs * capacity, kv_heads, head_dim]) when `dense` is set, else over the pool through `slots`.
    rows: bool = False
    row_slots: torch.Tensor | None = None


def _extend_metadata(batch: ForwardBatch) -> ExtendMetadata:
    q_lens = list(batch.extend_seq_lens_cpu)
    if (attend := _extend_attention(batch.token_to_kv_pool)) is not None:
        table = batch.req_to_token_pool.req_to_token
        seq_lens = list(batch.seq_lens_cpu)
        slots = table.index_select(0, batch.req_pool_indices)[:, : max(seq_lens)].to(torch.int64)
        as_rows = torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(q_lens, dtype=torch.int64)
        return ExtendMetadata([], [], q_lens, [], attend, slots, *as_rows)
    return _sdpa_extend_metadata(batch)


def _sdpa_extend_metadata(batch: ForwardBatch) -> ExtendMetadata:
    """The per-request slots, offsets and masks of the SDPA loop."""
    table = batch.req_to_token_pool.req_to_token
    q_lens = list(batch.extend_seq_lens_cpu)
    rows = batch.req_pool_indices.tolist()
    kv_slots = [table[row, :seq_len].to(torch.int64) for row, seq_len in zip(rows, batch.seq_lens_cpu)]
    q_starts = [0] * len(q_lens)
    for i in range(1, len(q_lens)):
        q_starts[i] = q_starts[i - 1] + q_lens[i - 1]
    device = batch.input_ids.device
    masks: list[torch.Tensor | None] = []
    for seq_len, prefix, q_len in zip(batch.seq_lens_cpu, batch.extend_prefix_lens_cpu, q_lens):
        if q_len == 1 or prefix == 0:
            masks.append(None)
            continue
        # New token j sits at position prefix + j and sees keys 0 .. prefix + j.
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(prefix, prefix + q_len, device=device)
        masks.append(key_pos[None, :] <= query_pos[:, None])
    return ExtendMetadata(kv_slots, q_starts, q_lens, masks)


def _decode_metadata(batch: ForwardBatch) -> DecodeMetadata:
    """The step's slots and mask, and `first_slot` for a lone request whose slots are consecutive
    (the backend picks how the others read their keys)."""
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
    return DecodeMetadata(slots, max_len, mask)


def _head_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as [slots * kv_heads, head_dim] holding KV head h of each slot, in
    (request, head, position) order: [bs * kv_heads * len]."""
    heads = torch.arange(kv_heads, device=slots.device)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


class TorchAttnBackend(AttentionBackend):
    """One SDPA call over the batch for decode, per-request SDPA for extend."""

    def __init__(self) -> None:
        self.dense = DenseKV()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            meta = _decode_metadata(batch)
            if meta.first_slot is not None:
                self.dense.drop()
            elif batch.batch_size == 1 and _rows_attention(batch.token_to_kv_pool) is not None:
                # A lone request reads its slots in place (no blocks to keep): the layers' batch-1 op
                # (layers/cpu_layer_row.py) takes this path too.
                self.dense.drop()
                meta = replace(meta, rows=True)
            elif (step := self.dense.plan(batch, meta.slots)) is not None:
                meta = replace(meta, dense=step)
                if _rows_attention(batch.token_to_kv_pool) is not None:
                    bs, capacity = step.keys[0].shape[:2]
                    local = torch.arange(bs)[:, None] * capacity + torch.arange(meta.max_len)[None, :]
                    meta = replace(meta, rows=True, row_slots=local)
            elif _rows_attention(batch.token_to_kv_pool) is not None:
                meta = replace(meta, rows=True)
            else:
                meta = replace(meta, head_rows=_head_rows(meta.slots, batch.token_to_kv_pool.num_kv_heads))
            batch.attn_metadata = meta
        else:
            self.dense.drop()
            batch.attn_metadata = _extend_metadata(batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if not isinstance(batch.attn_metadata, ExtendMetadata):
            self.init_forward_metadata(batch)
        meta: ExtendMetadata = batch.attn_metadata  # type: ignore[assignment]
        k_buffer = batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = batch.token_to_kv_pool.get_value_buffer(layer.layer_id)
        group = layer.num_heads // layer.num_kv_heads
        scaling, v_scale = _scales(batch, layer)
        if meta.rows is not None:
            if q.dtype == torch.float32:  # a float32 pool: its scales are 1
                qg = q.view(-1, layer.num_kv_heads, group, layer.head_dim)
                return meta.rows(qg, k_buffer, v_buffer, meta.slots, meta.seq_lens, meta.q_len_rows, scaling)
            # Queries of another dtype over a float32 pool: the SDPA loop, which needs its own metadata.
            meta = batch.attn_metadata = _sdpa_extend_metadata(batch)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        for slots, start, q_len, mask in zip(meta.kv_slots, meta.q_starts, meta.q_lens, meta.masks):
            qi = q[start : start + q_len].transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
            ki, vi = k_buffer[slots].to(q.dtype), v_buffer[slots].to(q.dtype)  # [seq_len, kv_heads, head_dim]
            if group > 1:
                # Query head h * group + j attends with KV head h (HF's repeat_interleave order).
                ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
            causal = q_len > 1 and mask is None
            oi = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1)[None],
                vi.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=causal,
                scale=scaling,
            )
            out[start : start + q_len] = oi[0].transpose(0, 1)
        if v_scale != 1.0:
            out.mul_(v_scale)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
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
        if meta.rows:  # float32 or bfloat16 on the CPU (_rows_attention): q has the pool's dtype
            keys, values, slots = k_buffer, v_buffer, meta.slots
            if meta.dense is not None:  # each request's rows one sequential run, not scattered slots
                meta.dense.store(layer.layer_id, k, v, pool, meta.max_len)
                keys = meta.dense.keys[layer.layer_id].view(-1, kv_heads, head_dim)
                values = meta.dense.values[layer.layer_id].view(-1, kv_heads, head_dim)
                slots = meta.row_slots
            attend = torch.ops.radixserve_cpu.decode_attention_rows
            out = attend(qg, keys, values, slots, batch.seq_lens, _scales(batch, layer)[0])
            return out.view(bs, layer.num_heads * head_dim)
        if meta.dense is not None:
            keys, values = meta.dense.store(layer.layer_id, k, v, pool, meta.max_len)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        elif meta.first_slot is not None:
            span = slice(meta.first_slot, meta.first_slot + meta.max_len)
            if bs == 1 and (attend := _row_attention(q, k_buffer, pool.v_scales[layer.layer_id])) is not None:
                # One request over a contiguous span: the C++ single-row attention, not SDPA's dispatch.
                out = attend(qg[0], k_buffer[span], v_buffer[span], _scales(batch, layer)[0])
                return out.view(1, layer.num_heads * head_dim)
            # [max_len, kv_heads, head_dim] slots -> [1, kv_heads, max_len, head_dim], a strided view.
            keys = k_buffer[span].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
            values = v_buffer[span].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
        else:
            assert meta.head_rows is not None
            keys = k_buffer.view(-1, head_dim).index_select(0, meta.head_rows)
            values = v_buffer.view(-1, head_dim).index_select(0, meta.head_rows)
            keys = keys.view(bs, kv_heads, meta.max_len, head_dim).to(q.dtype)
            values = values.view(bs, kv_heads, meta.max_len, head_dim).to(q.dtype)
        scaling, v_scale = _scales(batch, layer)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.mask, scale=scaling)
        if v_scale != 1.0:
            out.mul_(v_scale)
        return out.reshape(bs, layer.num_heads * head_dim)


# RS_CPU_ROW_ATTENTION=0 keeps SDPA for batch-1 CPU decode (for A/B runs).
ROW_ATTENTION_ENV = "RS_CPU_ROW_ATTENTION"


# Pool dtypes the C++ decode attention reads (bfloat16 widened as read; its sums are float32 either way).
ROW_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def _row_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_scale: float) -> Any:
    """kernels/cpu_matvec.py's decode_attention_row where it applies: q and pool on the CPU, both float32
    or both bfloat16, no V scale, the C++ library already loaded (the single-row products load it),
    RS_CPU_ROW_ATTENTION not 0."""
    if q.device.type != "cpu" or k_buffer.dtype not in ROW_ATTENTION_DTYPES or q.dtype != k_buffer.dtype or v_scale != 1.0:
        return None
    if os.environ.get(ROW_ATTENTION_ENV, "1") == "0":
        return None
    from kernels.cpu_matvec import row_attention  # imported where used: the CPU library's module

    return row_attention()


def _rows_attention(pool: Any) -> Any:
    """kernels/cpu_matvec.py's decode_attention_rows where it applies to a decode batch over `pool`: a
    float32 or bfloat16 pool on the CPU (its scales are 1; q has the model's dtype, the pool's), the C++
    library loaded, RS_CPU_ROW_ATTENTION not 0."""
    if (
        pool.device.type != "cpu"
        or pool.dtype not in ROW_ATTENTION_DTYPES
        or os.environ.get(ROW_ATTENTION_ENV, "1") == "0"
    ):
        return None
    from kernels.cpu_matvec import rows_attention  # imported where used: the CPU library's module

    return rows_attention()


def _extend_attention(pool: Any) -> Any:
    """kernels/cpu_matvec.py's extend_attention_rows where it applies to a prefill batch over `pool`: a
    float32 pool on an AVX-512 or AVX2 CPU, the C++ library loaded, RS_CPU_EXTEND_ATTENTION not 0."""
    if pool.device.type != "cpu" or pool.dtype != torch.float32:
        return None
    from kernels.cpu_matvec import extend_attention  # imported where used: the CPU library's module

    return extend_attention()


def _scales(batch: ForwardBatch, layer: AttentionLayer) -> tuple[float, float]:
    """The softmax scale with the layer's K scale folded in, and its V scale: attention over a float8
    pool's stored values, scaled so, is attention over the values they stand for."""
    pool = batch.token_to_kv_pool
    return layer.scaling * pool.k_scales[layer.layer_id], pool.v_scales[layer.layer_id]
