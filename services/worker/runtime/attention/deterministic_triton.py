"""The CUDA attention backend of --enable-deterministic-inference: decode attention with fixed-size KV
splits, and extend attention through the same kernel, one query token at a time.

The `triton` backend is not batch-invariant: decode's split count per request comes from the batch size
(max_kv_splits_for) and its key tile from tiles_for(batch size), and the extend kernel walks a request's
prefix and new tokens in tiles anchored at the chunk's start, so a token's reduction over its keys
changes with the batch, the chunking and the step kind.

Here (SGLang's "split tile size", as in its deterministic Triton backend):
- decode splits are SPLIT_TOKENS long at fixed positions (kernels.decode_attention's `split_tokens`),
  with one key tile (DECODE_TILES), and merged in split order: a request's result depends only on its own
  length. The merge's width comes from the context length, so decode CUDA graphs still capture; the
  grid's split dimension from the batch size (as the default backend's), each program walking every
  grid_splits-th split. (A grid of the context's 64 splits for 256 requests started 131k programs a layer,
  nearly all exiting at once: 329 us a layer against 188 for the default backend on the H200.)
- an extend step attends each new token as decode would attend it at its position (its K/V are stored
  in the pool first), through kernels/token_block_attention.py: the rows decode leaves empty (the GQA
  group padded to 16) hold the next tokens of the same request, so a key tile is read once for up to 8
  tokens (a 0.6B model's group of 2) and each row's arithmetic is still decode's. A token's attention is
  therefore the same bits whether it is prefilled whole, in chunks, or decoded. (Until 2026-12-06 each
  token ran the decode kernel alone and read its keys itself: 53 ms of a 2,048-token prompt's prefill on
  the H200.)

Extend CUDA graphs: a replay's per-token rows come from the graph's static metadata on the device (each
token's request from qo_indptr, its key count from its position; padded tokens get 0 keys and zeros),
with a split bound fixed at capture (GRAPH_SPLITS: requests of up to GRAPH_SPLITS x split_tokens
positions; longer ones run eagerly). An eager deterministic extend step of a 0.6B model spent ~40 ms
launching its ~250 kernels on the H200 host, whatever its size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import triton

from kernels.decode_attention import (
    WIDE_BATCH_TILES,
    DecodeTiles,
    fixed_size_kv_splits,
    max_kv_splits_for,
)
from kernels.token_block_attention import token_block_attention, token_blocks, tokens_per_block
from services.worker.runtime.attention.triton_backend import (
    TritonAttnBackend,
    TritonDecodeMetadata,
    TritonExtendMetadata,
    _Metadata,
)

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch

# Keys per KV split; a multiple of DECODE_TILES.block_n. Large batches used one split anyway, a lone
# long request gets one per 1024 keys.
SPLIT_TOKENS = 1024
DECODE_TILES = WIDE_BATCH_TILES
# Extend launches take at most this many float32 of split scratch (tokens x heads x splits x head_dim),
# and at most this many token blocks (the grid's second dimension, which CUDA caps at 65535).
EXTEND_SCRATCH_FLOATS = 1 << 26
EXTEND_MAX_BLOCKS = 32768
# Splits per token an extend CUDA graph holds (its scratch: tokens x heads x GRAPH_SPLITS x (head_dim + 1)
# float32, 68 MB for 2,048 tokens of a 16-head model).
GRAPH_SPLITS = 4


@dataclass
class TokenQueries:
    """An extend step as decode requests, one per new token: its request row, key count (position + 1)
    and splits, [tokens] each on the device; max_kv_splits bounds the splits (a power of two).
    qo_indptr [segments + 1]: the tokens of each request (a graph's padding is a last segment of tokens
    with 0 keys); block_bound(tokens) bounds token_blocks' count for blocks of that many tokens. The blocks themselves are
    made by the first layer, which knows the head counts (`blocks`, keyed by tokens per block)."""

    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_splits: torch.Tensor
    max_kv_splits: int
    qo_indptr: torch.Tensor
    block_bound: Callable[[int], int]
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def token_blocks(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens not in self.blocks:
            self.blocks[tokens] = token_blocks(self.qo_indptr, self.block_bound(tokens), tokens)
        return self.blocks[tokens]


class DeterministicTritonAttnBackend(TritonAttnBackend):
    """TritonAttnBackend with batch-invariant decode splits and a per-token extend path."""

    def __init__(
        self, context_len: int, split_tokens: int = SPLIT_TOKENS, tiles: DecodeTiles = DECODE_TILES
    ) -> None:
        super().__init__()
        if split_tokens < 1 or split_tokens % tiles.block_n:
            raise ValueError(
                f"split_tokens must be a positive multiple of {tiles.block_n}, got {split_tokens}"
            )
        self.split_tokens = split_tokens
        self.tiles = tiles
        self.decode_max_splits = triton.next_power_of_2(max(1, triton.cdiv(context_len, split_tokens)))
        self.graph_splits = min(GRAPH_SPLITS, self.decode_max_splits)
        self.extend_graph_max_seq_len = self.graph_splits * split_tokens

    def reserve(
        self,
        max_batch_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._scratch_for(max_batch_size * num_heads * self.decode_max_splits * (head_dim + 1), device)
        self._counters_for(max_batch_size * num_kv_heads, device)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if batch.forward_mode.is_decode():
            # Each program counts its request's splits from seq_lens (fixed_size_kv_splits' arithmetic).
            # The grid is sized by the batch, as the default backend's is; each program walks its share of
            # a request's splits (a result does not depend on which program runs a split).
            wanted = max_kv_splits_for(batch.batch_size, batch.token_to_kv_pool.num_kv_heads, self._sm_count(device))
            batch.attn_metadata = TritonDecodeMetadata(
                self.decode_max_splits, min(wanted, self.decode_max_splits)
            )
            return
        lens = list(batch.extend_seq_lens_cpu)
        qo_indptr = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64).to(device, non_blocking=True)
        num_tokens = int(sum(lens))
        req_rows = torch.repeat_interleave(
            batch.req_pool_indices, qo_indptr[1:] - qo_indptr[:-1], output_size=num_tokens
        )
        seq_lens = batch.positions[:num_tokens] + 1
        longest = max(batch.seq_lens_cpu, default=1)
        batch.attn_metadata = TokenQueries(
            req_rows,
            seq_lens,
            fixed_size_kv_splits(seq_lens, self.split_tokens),
            triton.next_power_of_2(max(1, triton.cdiv(longest, self.split_tokens))),
            qo_indptr,
            lambda tokens: sum(triton.cdiv(n, tokens) for n in lens),
        )

    def _metadata(self, batch: ForwardBatch, kind: type[_Metadata]) -> _Metadata:
        if kind is TritonExtendMetadata and isinstance(batch.attn_metadata, TritonExtendMetadata):
            # An extend CUDA graph's static table: derived once per forward, the first layer's.
            batch.attn_metadata = self._graph_token_queries(batch, batch.attn_metadata)
        if kind is TritonExtendMetadata and not isinstance(batch.attn_metadata, TokenQueries):
            raise ValueError("attn_metadata: call init_forward_metadata(batch) for this extend batch first")
        if kind is TritonExtendMetadata:
            return batch.attn_metadata  # type: ignore[return-value]
        return super()._metadata(batch, kind)

    def _graph_token_queries(self, batch: ForwardBatch, meta: TritonExtendMetadata) -> TokenQueries:
        """init_forward_metadata's per-token rows from a graph's static buffers, on the device: token t
        belongs to the first request whose qo_indptr end is past t; tokens past the total (padding) get
        0 keys, so their rows are zeros and read nothing."""
        num_tokens = batch.positions.shape[0]
        ends = meta.qo_indptr[1 : batch.batch_size + 1]
        token = torch.arange(num_tokens, dtype=ends.dtype, device=ends.device)
        owner = torch.searchsorted(ends, token, right=True)
        req_rows = batch.req_pool_indices[owner.clamp(max=batch.batch_size - 1)]
        seq_lens = torch.where(owner < batch.batch_size, batch.positions + 1, 0)
        # The padding is one more segment, so its tokens are in blocks too and get their zeros.
        tail = torch.full((1,), num_tokens, dtype=meta.qo_indptr.dtype, device=ends.device)
        qo_indptr = torch.cat([meta.qo_indptr[: batch.batch_size + 1], tail])
        segments = batch.batch_size + 1
        return TokenQueries(
            req_rows, seq_lens, fixed_size_kv_splits(seq_lens, self.split_tokens), self.graph_splits, qo_indptr,
            lambda tokens: triton.cdiv(num_tokens, tokens) + segments,
        )

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        meta: TritonExtendMetadata,
    ) -> torch.Tensor:
        """Each new token's attention as decode attends it at its position (K/V already stored), in blocks
        of consecutive tokens sharing key tiles (kernels/token_block_attention.py)."""
        tokens: TokenQueries = meta  # type: ignore[assignment]
        pool = batch.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)
        per_block = tokens_per_block(layer.num_heads, k_buffer.shape[1])
        block_first, block_count = tokens.token_blocks(per_block)
        out = torch.empty((q.shape[0], layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        splits = tokens.max_kv_splits
        rows = per_block * layer.num_heads * splits * (layer.head_dim + 1)
        per_launch = min(max(1, EXTEND_SCRATCH_FLOATS // rows), EXTEND_MAX_BLOCKS)
        num_blocks = block_first.shape[0]
        for first in range(0, num_blocks, per_launch):
            end = min(num_blocks, first + per_launch)
            if splits == 1:
                # One split writes straight to `out`: the scratch and the counters are never touched.
                scratch = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
                part_out = scratch.expand((end - first) * per_block, layer.num_heads, 1, layer.head_dim)
                part_lse = scratch[0].expand((end - first) * per_block, layer.num_heads, 1)
                counters = tokens.num_kv_splits
            else:
                part_out = part_lse = counters = None
            token_block_attention(
                q,
                k_buffer,
                pool.get_value_buffer(layer.layer_id),
                out,
                batch.req_to_token_pool.req_to_token,
                tokens.req_rows,
                tokens.seq_lens,
                tokens.num_kv_splits,
                block_first,
                block_count,
                splits,
                layer.scaling,
                self.split_tokens,
                self.tiles,
                blocks=(first, end),
                part_out=part_out,
                part_lse=part_lse,
                split_counters=counters,
            )
        return out

    def _decode_options(self) -> dict[str, Any]:
        """Decode with split_tokens-long splits and one key tile whatever the batch size."""
        return {"tiles": self.tiles, "split_tokens": self.split_tokens}

    def min_extend_chunk_tokens(self) -> int:
        """Any chunk: every new token is its own row here."""
        return 1
