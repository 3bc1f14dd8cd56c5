"""The `flashinfer` attention backend: FlashInfer's paged decode and prefill kernels over our pool.

An optional extra (`pip install flashinfer-python`; CUDA, float16/bfloat16 only): the import is guarded
and selecting the backend without the package, on the CPU or in float32 is a clear error.

The token-level pool is FlashInfer's paged KV cache with a page size of 1 (SGLang's flashinfer backend
does the same): each layer's K buffer [slots, kv_heads, head_dim] is, viewed as [slots, 1, kv_heads,
head_dim], an "NHD" cache of one-token pages, and a request's page list is its req_to_token row. So per
step the backend builds, without a host sync:

- kv_indptr (host, int32 [bs + 1]): cumulative sequence lengths, from the batch's host-side lengths;
- kv_indices (device, int32 [sum of lengths]): the slots of every request's positions 0..len-1, gathered
  from req_to_token on the device;
- kv_last_page_len: all ones (every page is full);
- qo_indptr (extend only, host): cumulative new-token counts.

FlashInfer's wrappers `plan` once per step (their host-side scheduling; the plan needs the heads, head
dim and dtypes, so it happens at the step's first layer) and `run` per layer. Its causal mask for a
request with more keys than queries aligns the queries to the end, which is our extend: new tokens
after a cached prefix. The new tokens' K/V are stored into the pool before attention reads it.

CUDA graphs are not captured with this backend (the plans are host work per step; the model runner
says so when it skips them), so it serves as a peer of the triton backend rather than its replacement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.worker.runtime.attention.base import AttentionBackend

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import AttentionLayer, ForwardBatch

# FlashInfer's recommended float workspace for split-K partial results.
WORKSPACE_BYTES = 128 * 2**20
# From this many query heads per KV head, decode runs on FlashInfer's tensor-core (prefill) kernels,
# as SGLang chooses; below, its CUDA-core decode kernel.
TENSOR_CORE_GROUP = 4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer() -> Any:
    """The flashinfer module, or an ImportError that says how to get it."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "attention_backend='flashinfer' needs the optional flashinfer-python package (CUDA only): "
            "pip install flashinfer-python; or use attention_backend='triton'"
        ) from e
    return flashinfer


def check_flashinfer_target(device: torch.device, dtype: torch.dtype) -> None:
    """FlashInfer's kernels run on CUDA in float16/bfloat16; anything else is a configuration error."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend='flashinfer' runs on CUDA only, not on {device.type}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention_backend='flashinfer' needs dtype float16 or bfloat16, got {dtype}")


@dataclass
class FlashInferMetadata:
    """One step's page table (see the module docstring) and whether a wrapper has planned it yet."""

    kv_indptr: torch.Tensor  # host int32 [bs + 1]
    kv_indices: torch.Tensor  # device int32 [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # host int32 [bs], ones
    qo_indptr: torch.Tensor | None  # host int32 [bs + 1]; None for decode
    planned: bool = False


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


def kv_page_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, total: int
) -> torch.Tensor:
    """int32 [total]: for each request in order, req_to_token[row, 0 .. seq_len - 1]. `total` (the sum of
    seq_lens, known on the host) sizes the result, so nothing waits for the device."""
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = torch.repeat_interleave(req_pool_indices.to(device=device, dtype=torch.int64), seq_lens, output_size=total)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    positions = torch.arange(total, device=device) - torch.repeat_interleave(starts, seq_lens, output_size=total)
    return req_to_token[rows, positions].to(torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper and BatchPrefillWithPagedKVCacheWrapper over
    the token pool (page size 1). The wrappers and their workspace are made at the first step."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._flashinfer = import_flashinfer()
        self._workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._decode_wrapper: Any = None
        self._prefill_wrapper: Any = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        lengths = [int(n) for n in batch.seq_lens_cpu]
        kv_indptr = _indptr(lengths)
        indices = kv_page_indices(
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens, int(kv_indptr[-1])
        )
        qo_indptr = None if batch.forward_mode.is_decode() else _indptr(list(batch.extend_seq_lens_cpu))
        batch.attn_metadata = FlashInferMetadata(
            kv_indptr, indices, torch.ones(len(lengths), dtype=torch.int32), qo_indptr
        )

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch, decode=True)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch, decode=False)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
        decode: bool,
    ) -> torch.Tensor:
        meta = self._metadata(batch, decode)
        cache = self._store_and_cache(k, v, layer, batch)
        wrapper = self._wrapper(decode, layer, q.device)
        if not meta.planned:
            shape = (layer.num_heads, layer.num_kv_heads, layer.head_dim, 1)  # the last: page size
            options = {"sm_scale": layer.scaling, "q_data_type": q.dtype, "kv_data_type": cache[0].dtype}
            pages = (meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
            if decode:
                wrapper.plan(*pages, *shape, **options)
            else:
                wrapper.plan(meta.qo_indptr, *pages, *shape, causal=True, **options)
            meta.planned = True
        out = wrapper.run(q.view(-1, layer.num_heads, layer.head_dim), cache)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)

    def _metadata(self, batch: ForwardBatch, decode: bool) -> FlashInferMetadata:
        meta = batch.attn_metadata
        if not isinstance(meta, FlashInferMetadata) or (meta.qo_indptr is None) != decode:
            raise ValueError(
                f"attn_metadata: call init_forward_metadata(batch) for this {batch.forward_mode.value} batch first"
            )
        return meta

    def _store_and_cache(
        self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V, then the layer's pool as FlashInfer's NHD cache of 1-token pages."""
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        return k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)

    def _wrapper(self, decode: bool, layer: AttentionLayer, device: torch.device) -> Any:
        """The step's wrapper (made at first use, sharing one workspace: decode and prefill never run
        in the same step)."""
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.zeros(self._workspace_bytes, dtype=torch.uint8, device=device)
            self._decode_wrapper = self._prefill_wrapper = None
        fi = self._flashinfer
        if decode:
            if self._decode_wrapper is None:
                tensor_cores = layer.num_heads // layer.num_kv_heads >= TENSOR_CORE_GROUP
                self._decode_wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores
                )
            return self._decode_wrapper
        if self._prefill_wrapper is None:
            self._prefill_wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._prefill_wrapper
