"""The `triton` attention backend: kernels/ decode (split-K) and extend attention over the paged pool.

Per step, init_forward_metadata turns the batch into the few device tensors the kernels read (req_to_token
rows and lengths, plus split counts for decode or new-token offsets and prefix lengths for extend); each
layer stores its new K/V with one kernel and attends with one more (decode merges its splits in that launch:
the last split program of a request and KV head to finish merges). Unrotated q/k (`forward_with_rope`) get
their q/k norm, rotary and KV store in that store launch (kernels/qk_norm_rope.py), or at decode in the
attention launch (kernels/decode_rope.py) unless rows share requests (AttentionBackend says why).

CUDA graphs: decode's grid depends on the batch size alone (kernels.decode_attention.max_kv_splits_for),
its split counts are computed on the device from seq_lens, and its scratch and its merge's arrival
counters (which the kernel leaves at zero) come from buffers the backend keeps, so a decode step launches
nothing that depends on host-side lengths and never syncs. Extend attention's grid is the length of its
block table (kernels.extend_attention), so a graph captured over static metadata buffers sized for a
token bucket (extend_blocks_bound) replays any batch that fits the bucket once fill_extend_metadata has
written that batch's offsets, prefix lengths and block table into them. The fused prologue reads only
the step's positions and out_cache_loc, the rotary tables, the norm weights and the pool, all tensors
that keep their addresses between replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kernels.decode_attention import decode_attention, max_kv_splits_for
from kernels.decode_rope import DecodeRope, decode_rope_for
from kernels.extend_attention import (
    PAD_ENTRY,
    TABLE_ROWS,
    ExtendTiles,
    alloc_extend_partials,
    extend_attention,
    extend_block_table,
)
from kernels.kv_store import store_kv
from kernels.qk_norm_rope import qk_norm_rope_
from services.worker.runtime.attention.base import AttentionBackend
from services.worker.runtime.sampling.penalties import to_device_async

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch
    from services.worker.runtime.layers.layernorm import RMSNorm
    from services.worker.runtime.layers.rotary import RotaryEmbedding

# Used where the device reports no multiprocessor count (the CPU interpreter): only shapes the grid.
_DEFAULT_NUM_SMS = 8
# Extend attention's launch shape: its block_m is also the block table's, so both are read from here.
EXTEND_TILES = ExtendTiles()
# Rows of the extend metadata buffer (int32 [EXTEND_METADATA_ROWS, width]).
EXTEND_METADATA_ROWS = 2 + TABLE_ROWS
_QO_INDPTR, _PREFIX_LENS, _BLOCK_TABLE = 0, 1, slice(2, 2 + TABLE_ROWS)
# Extend entries that split blocks' prefixes may add to a batch's table (kernels.extend_attention):
# scratch slots, capped so the scratch stays near 64 MB (slots x heads x block_m x head_dim x 4 bytes).
MAX_EXTEND_SPLIT_SLOTS = 64


def extend_split_slots(num_heads: int) -> int:
    return max(2, min(MAX_EXTEND_SPLIT_SLOTS, 1024 // max(1, num_heads)))


@dataclass(frozen=True)
class ExtendSplitting:
    """What extend_block_table needs to split long prefixes: heads per rank, SMs, scratch slots."""

    num_heads: int
    num_sms: int
    max_split_slots: int


@dataclass(frozen=True)
class TritonDecodeMetadata:
    """max_kv_splits: the bound on a request's splits (the merge's width; the kernel counts each request's
    from its length, decode_attention with num_kv_splits=None); grid_splits: programs per (request, kv_head)
    walking them (0: max_kv_splits, a split each)."""

    max_kv_splits: int
    grid_splits: int = 0


@dataclass(frozen=True)
class TritonExtendMetadata:
    """qo_indptr: [bs + 1] int32 row offsets of each request's new tokens; prefix_lens: [bs] int32;
    block_table: [TABLE_ROWS, num_blocks] int32 (kernels.extend_attention.extend_block_table), padded
    (its length sizes the grid). All three are views of one int32 buffer [EXTEND_METADATA_ROWS, width]."""

    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def view(cls, buffer: torch.Tensor, batch_size: int, num_blocks: int) -> TritonExtendMetadata:
        """The metadata of a batch of batch_size requests and num_blocks table entries over `buffer`
        (as extend_metadata_rows lays it out, at least max(batch_size + 1, num_blocks) wide)."""
        return cls(
            qo_indptr=buffer[_QO_INDPTR, : batch_size + 1],
            prefix_lens=buffer[_PREFIX_LENS, :batch_size],
            block_table=buffer[_BLOCK_TABLE, :num_blocks],
        )


def extend_metadata_rows(
    prefix_lens: list[int],
    extend_lens: list[int],
    width: int | None,
    splitting: ExtendSplitting | None = None,
    num_blocks: int | None = None,
) -> torch.Tensor:
    """An extend batch's metadata on the host, int32 [EXTEND_METADATA_ROWS, width]: qo_indptr,
    prefix_lens and the block table for EXTEND_TILES (with its prefixes split as `splitting` allows).
    Past the batch, qo_indptr repeats the token total and prefix lengths are 0 (requests with no tokens:
    a graph's padded requests), and the table holds padding entries. The table has num_blocks entries
    (default: as many as it needs; a graph's bound for a replay) and width None is as wide as needed."""
    split = splitting or ExtendSplitting(1, 0, 0)
    table = extend_block_table(
        prefix_lens, extend_lens, EXTEND_TILES.block_m, num_blocks,
        num_heads=split.num_heads, num_sms=split.num_sms, max_split_slots=split.max_split_slots,
    )  # fmt: skip
    if width is None:
        width = max(len(extend_lens) + 1, table.shape[1])
    rows = torch.zeros((EXTEND_METADATA_ROWS, width), dtype=torch.int32)
    indptr = torch.tensor([0, *extend_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows[_QO_INDPTR] = indptr[-1]
    rows[_QO_INDPTR, : len(indptr)] = indptr
    rows[_PREFIX_LENS, : len(prefix_lens)] = torch.tensor(prefix_lens, dtype=torch.int32)
    rows[_BLOCK_TABLE] = torch.tensor(PAD_ENTRY, dtype=torch.int32)[:, None]
    rows[_BLOCK_TABLE, : table.shape[1]] = table
    return rows


_Metadata = TypeVar("_Metadata", TritonDecodeMetadata, TritonExtendMetadata)


def _fusable_norms(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool:
    """The fused prologue takes both per-head norms or neither, sharing one eps (as Qwen3's do)."""
    if q_norm is None or k_norm is None:
        return q_norm is k_norm
    return q_norm.eps == k_norm.eps


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


class TritonAttnBackend(AttentionBackend):
    """Triton kernels over the token-paged KV pool. Stateless between steps apart from two reusable
    device buffers (decode scratch and the merge's arrival counters), which only grow. extend_graph_max_seq_len: the longest request an extend CUDA graph may hold (None: any)."""

    extend_graph_max_seq_len: int | None = None

    def __init__(self) -> None:
        self._num_sms: dict[torch.device, int] = {}
        self._scratch: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        # Set by reserve(): extend entries may then split long prefixes, into these buffers.
        self._splitting: ExtendSplitting | None = None
        self._extend_partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def reserve(
        self,
        max_batch_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        """Allocate the decode buffers for every batch size up to max_batch_size now, so they never
        move afterwards (call before capturing CUDA graphs: a graph keeps the addresses it saw)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        sms = self._sm_count(device)
        worst = max(bs * max_kv_splits_for(bs, num_kv_heads, sms) for bs in range(1, max_batch_size + 1))
        self._scratch_for(worst * num_heads * (head_dim + 1), device)
        self._counters_for(max_batch_size * num_kv_heads, device)
        if self._extend_partials is None or self._extend_partials[0].device != device:
            slots = extend_split_slots(num_heads)
            self._extend_partials = alloc_extend_partials(slots, num_heads, EXTEND_TILES.block_m, head_dim, device)
            self._splitting = ExtendSplitting(num_heads, sms, slots)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if batch.forward_mode.is_decode():
            bs = batch.batch_size
            max_splits = max_kv_splits_for(bs, batch.token_to_kv_pool.num_kv_heads, self._sm_count(device))
            # Each program counts its request's splits from seq_lens (kv_splits_per_request's arithmetic):
            # no launches for them ahead of the first layer.
            batch.attn_metadata = TritonDecodeMetadata(max_splits)
            return
        # An eager step's table is exactly as long as its entries (one device copy for all of it).
        bs = batch.batch_size
        rows = extend_metadata_rows(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, None, self._splitting)
        num_blocks = int((rows[_BLOCK_TABLE][0] >= 0).sum())
        batch.attn_metadata = TritonExtendMetadata.view(to_device_async(rows, device), bs, num_blocks)

    @staticmethod
    def extend_blocks_bound(num_tokens: int, batch_size: int) -> int:
        """Query blocks of any extend batch of at most num_tokens tokens and batch_size requests: each
        request's last block may be partial, so sum(cdiv(n_i, block_m)) < num_tokens / block_m + bs; split
        prefixes add at most MAX_EXTEND_SPLIT_SLOTS entries."""
        return -(-num_tokens // EXTEND_TILES.block_m) + batch_size + MAX_EXTEND_SPLIT_SLOTS

    def fill_extend_metadata(
        self, buffer: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], num_blocks: int | None = None
    ) -> None:
        """Write a batch's extend metadata into a static int32 [EXTEND_METADATA_ROWS, width] buffer in
        place (one copy that does not wait for the device), its table within num_blocks entries (the
        bound of the graph that replays it), so the TritonExtendMetadata.view a CUDA graph was captured
        over describes the batch."""
        rows = extend_metadata_rows(prefix_lens, extend_lens, buffer.shape[1], self._splitting, num_blocks)
        if buffer.is_cuda:
            rows = rows.pin_memory()
        buffer.copy_(rows, non_blocking=True)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(batch, TritonExtendMetadata)
        self._store(k, v, layer, batch)
        return self._extend(q, k, v, layer, batch, meta)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = self._metadata(batch, TritonDecodeMetadata)
        self._store(k, v, layer, batch)
        return self._decode(q, layer, batch, meta)

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
        """Norm (optional), rotary and the KV store in one launch that rotates q and k in place, then
        attention straight from the pool (no separate store)."""
        if not _fusable_norms(q_norm, k_norm):
            return super().forward_with_rope(positions, q, k, v, rotary_emb, q_norm, k_norm, layer, batch)
        decode = batch.forward_mode.is_decode()
        meta = self._metadata(batch, TritonDecodeMetadata if decode else TritonExtendMetadata)
        pool = batch.token_to_kv_pool
        norms = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None and k_norm is not None else ()
        fuse = decode and not self.decode_rows_share_requests  # (why not: AttentionBackend)
        rope = decode_rope_for(layer.head_dim, positions, k, v, rotary_emb, batch.out_cache_loc, *norms) if fuse else None
        if rope is not None:  # one launch: decode attention rotates q and k and stores the new K/V itself
            return self._decode(q, layer, batch, meta, rope)
        qk_norm_rope_(
            positions,
            q,
            k,
            rotary_emb.cos_cache,
            rotary_emb.sin_cache,
            layer.head_dim,
            q_weight=q_norm.weight if q_norm is not None else None,
            k_weight=k_norm.weight if k_norm is not None else None,
            eps=q_norm.eps if q_norm is not None else 0.0,
            v=v,
            k_buffer=pool.get_key_buffer(layer.layer_id),
            v_buffer=pool.get_value_buffer(layer.layer_id),
            out_cache_loc=batch.out_cache_loc,
            k_scale=pool.k_scales[layer.layer_id],
            v_scale=pool.v_scales[layer.layer_id],
        )
        if decode:
            return self._decode(q, layer, batch, meta)
        return self._extend(q, k, v, layer, batch, meta)

    def _metadata(self, batch: ForwardBatch, kind: type[_Metadata]) -> _Metadata:
        meta = batch.attn_metadata
        if not isinstance(meta, kind):
            mode = batch.forward_mode.value
            raise ValueError(f"attn_metadata: call init_forward_metadata(batch) for this {mode} batch first")
        return meta

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        meta: TritonExtendMetadata,
    ) -> torch.Tensor:
        """Attention of the new tokens (k, v: theirs, already in the pool too) over their requests."""
        pool = batch.token_to_kv_pool
        out = torch.empty((q.shape[0], layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        return extend_attention(
            q,
            k,
            v,
            out,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            meta.prefix_lens,
            meta.qo_indptr,
            meta.block_table,
            layer.scaling,
            EXTEND_TILES,
            self._extend_partials,
            k_scale=pool.k_scales[layer.layer_id],
            v_scale=pool.v_scales[layer.layer_id],
        )

    def _decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, meta: TritonDecodeMetadata,
        rope: DecodeRope | None = None,
    ) -> torch.Tensor:
        """Split-K decode attention over the pool (the new token's K/V already stored, or stored with `rope`)."""
        pool = batch.token_to_kv_pool
        bs = q.shape[0]
        out = torch.empty((bs, layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        part_out, part_lse = self._decode_scratch(bs, layer.num_heads, meta.max_kv_splits, layer.head_dim, q.device)
        return decode_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            out,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            None,  # each program counts its request's splits from seq_lens
            meta.max_kv_splits,
            layer.scaling,
            part_out,
            part_lse,
            split_counters=self._counters_for(bs * pool.get_key_buffer(layer.layer_id).shape[1], q.device),
            k_scale=pool.k_scales[layer.layer_id],
            v_scale=pool.v_scales[layer.layer_id],
            rope=rope,
            grid_splits=meta.grid_splits,
            **self._decode_options(),
        )

    def _decode_options(self) -> dict[str, Any]:
        """Extra decode_attention arguments (the deterministic backend fixes its tiles and splits)."""
        return {}

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> None:
        pool = batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        scales = pool.k_scales[layer.layer_id], pool.v_scales[layer.layer_id]
        store_kv(k_buffer, v_buffer, batch.out_cache_loc, k, v, *scales)

    def min_extend_chunk_tokens(self) -> int:
        """One query block (EXTEND_TILES.block_m rows): the extend kernel computes whole blocks, so a
        shorter chunk costs as much attention as a full block. (Before the kernel split long prefixes
        over several programs, a chunk below a wave of the SMs cost as much as a full wave: a 64-token
        chunk after a 30k prefix ran 24 ms per step on the H200, 0.6B-shaped.)"""
        return EXTEND_TILES.block_m

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = _num_sms(device)
        return self._num_sms[device]

    def _scratch_for(self, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

    def _counters_for(self, numel: int, device: torch.device) -> torch.Tensor:
        """The decode merge's arrival counters: zeroed once; every decode call leaves them zero."""
        buf = self._counters
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._counters = torch.zeros(max(numel, 256), dtype=torch.int32, device=device)
        return buf[:numel]

    def _decode_scratch(
        self, bs: int, num_heads: int, max_splits: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views into one float32 buffer: partial outputs [bs, heads, splits, head_dim] then their lse
        [bs, heads, splits]. Every layer of a step reuses it (layers run one after another)."""
        n_out = bs * num_heads * max_splits * head_dim
        n_lse = bs * num_heads * max_splits
        buf = self._scratch_for(n_out + n_lse, device)
        part_out = buf[:n_out].view(bs, num_heads, max_splits, head_dim)
        part_lse = buf[n_out : n_out + n_lse].view(bs, num_heads, max_splits)
        return part_out, part_lse
