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
- an extend step runs that same kernel with one "request" per new token (the token's request row, its
  position + 1 keys; its K/V are stored in the pool first). A token's attention is therefore the same
  program over the same keys whether it is prefilled whole, in chunks, or decoded: bit for bit.
The price is the extend path: each new token reads its keys itself instead of sharing a tile of them
with the 127 other rows of a query block.

Extend CUDA graphs: a replay's per-token rows come from the graph's static metadata on the device (each
token's request from qo_indptr, its key count from its position; padded tokens get 0 keys and zeros),
with a split bound fixed at capture (GRAPH_SPLITS: requests of up to GRAPH_SPLITS x split_tokens
positions; longer ones run eagerly). An eager deterministic extend step of a 0.6B model spent ~40 ms
launching its ~250 kernels on the H200 host, whatever its size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton

from kernels.decode_attention import (
    WIDE_BATCH_TILES,
    DecodeTiles,
    decode_attention,
    fixed_size_kv_splits,
    max_kv_splits_for,
)
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
# and at most this many tokens (the grid's second dimension, which CUDA caps at 65535).
EXTEND_SCRATCH_FLOATS = 1 << 26
EXTEND_MAX_TOKENS = 32768
# Splits per token an extend CUDA graph holds (its scratch: tokens x heads x GRAPH_SPLITS x (head_dim + 1)
# float32, 68 MB for 2,048 tokens of a 16-head model).
GRAPH_SPLITS = 4


@dataclass(frozen=True)
class TokenQueries:
    """An extend step as decode requests, one per new token: its request row, key count (position + 1)
    and splits, [tokens] each on the device; max_kv_splits bounds the splits (a power of two)."""

    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_splits: torch.Tensor
    max_kv_splits: int


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
        self._splits(max_batch_size, device)
        self._scratch_for(max_batch_size * num_heads * self.decode_max_splits * (head_dim + 1), device)
        self._counters_for(max_batch_size * num_kv_heads, device)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if batch.forward_mode.is_decode():
            splits = self._splits(batch.batch_size, device)
            fixed_size_kv_splits(batch.seq_lens, self.split_tokens, out=splits)
            # The grid is sized by the batch, as the default backend's is; each program walks its share of
            # a request's splits (a result does not depend on which program runs a split).
            wanted = max_kv_splits_for(batch.batch_size, batch.token_to_kv_pool.num_kv_heads, self._sm_count(device))
            batch.attn_metadata = TritonDecodeMetadata(
                splits, self.decode_max_splits, min(wanted, self.decode_max_splits)
            )
            return
        counts = torch.tensor(list(batch.extend_seq_lens_cpu), dtype=torch.int64).to(
            device, non_blocking=True
        )
        num_tokens = int(sum(batch.extend_seq_lens_cpu))
        req_rows = torch.repeat_interleave(batch.req_pool_indices, counts, output_size=num_tokens)
        seq_lens = batch.positions[:num_tokens] + 1
        longest = max(batch.seq_lens_cpu, default=1)
        batch.attn_metadata = TokenQueries(
            req_rows,
            seq_lens,
            fixed_size_kv_splits(seq_lens, self.split_tokens),
            triton.next_power_of_2(max(1, triton.cdiv(longest, self.split_tokens))),
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
        return TokenQueries(
            req_rows, seq_lens, fixed_size_kv_splits(seq_lens, self.split_tokens), self.graph_splits
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
        """Each new token's attention as a decode of its request at its position (K/V already stored)."""
        tokens: TokenQueries = meta  # type: ignore[assignment]
        pool = batch.token_to_kv_pool
        n = tokens.req_rows.shape[0]
        width = layer.num_heads * layer.head_dim
        out = torch.empty((q.shape[0], width), dtype=q.dtype, device=q.device)
        splits = tokens.max_kv_splits
        per_launch = max(1, EXTEND_SCRATCH_FLOATS // (layer.num_heads * splits * (layer.head_dim + 1)))
        per_launch = min(per_launch, EXTEND_MAX_TOKENS)
        for start in range(0, n, per_launch):
            end = min(n, start + per_launch)
            if splits == 1:
                # One split writes straight to `out`: the scratch is never read, only its shape checked.
                scratch = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
                part_out = scratch.expand(end - start, layer.num_heads, 1, layer.head_dim)
                part_lse = scratch[0].expand(end - start, layer.num_heads, 1)
            else:
                part_out = torch.empty(
                    (end - start, layer.num_heads, splits, layer.head_dim),
                    dtype=torch.float32,
                    device=q.device,
                )
                part_lse = torch.empty(
                    (end - start, layer.num_heads, splits), dtype=torch.float32, device=q.device
                )
            decode_attention(
                q[start:end],
                pool.get_key_buffer(layer.layer_id),
                pool.get_value_buffer(layer.layer_id),
                out[start:end],
                batch.req_to_token_pool.req_to_token,
                tokens.req_rows[start:end],
                tokens.seq_lens[start:end],
                tokens.num_kv_splits[start:end],
                splits,
                layer.scaling,
                part_out,
                part_lse,
                tiles=self.tiles,
                split_tokens=self.split_tokens,
            )
        return out

    def _decode_options(self) -> dict[str, Any]:
        """Decode with split_tokens-long splits and one key tile whatever the batch size."""
        return {"tiles": self.tiles, "split_tokens": self.split_tokens}

    def min_extend_chunk_tokens(self) -> int:
        """Any chunk: every new token is its own row here."""
        return 1
