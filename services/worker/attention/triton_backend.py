"""The `triton` attention backend: kernels/ decode (split-K) and extend attention over the paged pool.

Per step, init_forward_metadata turns the batch into the few device tensors the kernels read (the
req_to_token rows and lengths the batch already has, plus per-request split counts for decode or
cumulative new-token offsets and prefix lengths for extend); every layer then stores its new K/V with
one kernel and attends with one (extend) or two (decode) more.

CUDA graphs: decode's grid depends on the batch size alone (kernels.decode_attention.max_kv_splits_for),
its split counts are computed on the device from seq_lens, and its scratch comes from a buffer the
backend keeps, so a decode step launches nothing that depends on host-side lengths and never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.decode_attention import decode_attention, kv_splits_per_request, max_kv_splits_for
from kernels.extend_attention import extend_attention
from kernels.kv_store import store_kv
from services.worker.attention.base import AttentionBackend
from services.worker.sampling.penalties import to_device_async

if TYPE_CHECKING:
    from services.worker.forward_batch import ForwardBatch
    from services.worker.layers.attention import RadixAttention

# Used where the device reports no multiprocessor count (the CPU interpreter): only shapes the grid.
_DEFAULT_NUM_SMS = 8


@dataclass(frozen=True)
class TritonDecodeMetadata:
    """num_kv_splits: [bs] int32 splits each request uses; max_kv_splits: the grid's split bound."""

    num_kv_splits: torch.Tensor
    max_kv_splits: int


@dataclass(frozen=True)
class TritonExtendMetadata:
    """qo_indptr: [bs + 1] int32 row offsets of each request's new tokens; prefix_lens: [bs] int32;
    max_extend_len: the longest request's new-token count (sizes the grid)."""

    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    max_extend_len: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


class TritonAttnBackend(AttentionBackend):
    """Triton kernels over the token-paged KV pool. Stateless between steps apart from two reusable
    device buffers (decode split counts and decode scratch), which only grow."""

    def __init__(self) -> None:
        self._num_sms: dict[torch.device, int] = {}
        self._splits_buffer: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

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
        self._splits(max_batch_size, device)
        self._scratch_for(worst * num_heads * (head_dim + 1), device)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        if batch.forward_mode.is_decode():
            bs = batch.batch_size
            max_splits = max_kv_splits_for(bs, batch.token_to_kv_pool.num_kv_heads, self._sm_count(device))
            splits = self._splits(bs, device)
            kv_splits_per_request(batch.seq_lens, max_splits, out=splits)
            batch.attn_metadata = TritonDecodeMetadata(splits, max_splits)
            return
        extend_lens = batch.extend_seq_lens_cpu
        indptr = [0]
        for n in extend_lens:
            indptr.append(indptr[-1] + n)
        packed = to_device_async(torch.tensor(indptr + batch.extend_prefix_lens_cpu, dtype=torch.int32), device)
        batch.attn_metadata = TritonExtendMetadata(
            qo_indptr=packed[: len(indptr)],
            prefix_lens=packed[len(indptr) :],
            max_extend_len=max(extend_lens, default=0),
        )

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonExtendMetadata):
            raise ValueError("attn_metadata: call init_forward_metadata(batch) for this extend batch first")
        k_buffer, v_buffer = self._store(k, v, layer, batch)
        out = torch.empty((q.shape[0], layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        return extend_attention(
            q,
            k,
            v,
            out,
            k_buffer,
            v_buffer,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            meta.prefix_lens,
            meta.qo_indptr,
            meta.max_extend_len,
            layer.scaling,
        )

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonDecodeMetadata):
            raise ValueError("attn_metadata: call init_forward_metadata(batch) for this decode batch first")
        k_buffer, v_buffer = self._store(k, v, layer, batch)
        bs = q.shape[0]
        out = torch.empty((bs, layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        part_out, part_lse = self._decode_scratch(
            bs, layer.num_heads, meta.max_kv_splits, layer.head_dim, q.device
        )
        return decode_attention(
            q,
            k_buffer,
            v_buffer,
            out,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            meta.num_kv_splits,
            meta.max_kv_splits,
            layer.scaling,
            part_out,
            part_lse,
        )

    def _store(
        self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = batch.token_to_kv_pool
        k_buffer = pool.get_key_buffer(layer.layer_id)
        v_buffer = pool.get_value_buffer(layer.layer_id)
        store_kv(k_buffer, v_buffer, batch.out_cache_loc, k, v)
        return k_buffer, v_buffer

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = _num_sms(device)
        return self._num_sms[device]

    def _splits(self, bs: int, device: torch.device) -> torch.Tensor:
        buf = self._splits_buffer
        if buf is None or buf.numel() < bs or buf.device != device:
            buf = self._splits_buffer = torch.empty(max(bs, 256), dtype=torch.int32, device=device)
        return buf[:bs]

    def _scratch_for(self, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

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
