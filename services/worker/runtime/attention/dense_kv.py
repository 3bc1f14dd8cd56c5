"""The running decode batch's keys and values in dense blocks, kept from one decode step to the next
(the torch attention backend's decode path on CPU when the batch's slots are not one consecutive run).

A decode batch's KV slots are not consecutive: every step allocates one slot per request, so the
requests' tokens interleave in the pool, and attending over the pool means gathering every key and
value of every layer at every step (SmolLM2, bfloat16, 16 requests of ~130 tokens on a 2-core
machine: 4.6-6.3 ms of a 41-48 ms step, random reads of the whole live KV plus a copy of it, whose
write-back also slows the linears that follow). While the same requests keep decoding, the blocks here
need only each step's new key and value: the batch's keys are gathered once (when the batch changes,
or outgrows the blocks' capacity) and then appended to. The pool stays the source of truth (every step
still stores its K/V there), so the blocks can be dropped at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.mem.memory_pool import store_rows

if TYPE_CHECKING:
    from services.worker.mem.memory_pool import TokenToKVPool
    from services.worker.runtime.forward_batch import ForwardBatch

# The blocks (all layers, keys and values) may take at most this much memory; batches that would need
# more gather from the pool at every step instead.
DENSE_KV_MAX_BYTES = 256 * 2**20
# Capacity is the longest sequence rounded up to a multiple of this, plus as much again: the blocks
# are regathered for growth at most once per this many steps.
DENSE_KV_HEADROOM = 64


@dataclass(frozen=True)
class DenseStep:
    """One decode step's use of the blocks. `fill_slots` [bs * capacity]: the pool slots to gather into
    the blocks (a rebuild; padding reads slot 0), or None when the blocks hold every earlier token and
    only this step's go in, at rows `new_rows` [bs] of a block viewed as [bs * capacity, kv_heads *
    head_dim]."""

    keys: list[torch.Tensor]  # per layer [bs, capacity, kv_heads, head_dim]
    values: list[torch.Tensor]
    fill_slots: torch.Tensor | None
    new_rows: torch.Tensor | None

    def store(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, pool: TokenToKVPool, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring layer `layer_id`'s blocks up to date (after the pool stored this step's k and v) and
        return its keys and values [bs, kv_heads, length, head_dim] (strided views of the blocks)."""
        keys, values = self.keys[layer_id], self.values[layer_id]
        bs, _, kv_heads, head_dim = keys.shape
        row = kv_heads * head_dim
        if self.fill_slots is not None:
            k_pool, v_pool = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            torch.index_select(k_pool.view(-1, row), 0, self.fill_slots, out=keys.view(-1, row))
            torch.index_select(v_pool.view(-1, row), 0, self.fill_slots, out=values.view(-1, row))
        else:
            assert self.new_rows is not None
            if keys.dtype == torch.float32 and store_rows(
                k, v, keys.view(-1, row), values.view(-1, row), self.new_rows
            ):
                return keys[:, :length].transpose(1, 2), values[:, :length].transpose(1, 2)
            # As the pool stored them (a float8 pool: scaled, clipped and rounded).
            new_k = pool.quantize_k(layer_id, k.view(bs, row))
            new_v = pool.quantize_v(layer_id, v.view(bs, row))
            _copyable(keys.view(-1, row)).index_copy_(0, self.new_rows, _copyable(new_k))
            _copyable(values.view(-1, row)).index_copy_(0, self.new_rows, _copyable(new_v))
        return keys[:, :length].transpose(1, 2), values[:, :length].transpose(1, 2)


def _copyable(x: torch.Tensor) -> torch.Tensor:
    """x, or for float8 (which CPU index_copy_ does not take) its bytes."""
    return x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


class DenseKV:
    """Dense per-layer K and V blocks for the decode batch, reused across steps while they can be.

    `plan` is called once per decode step that may use them; `drop` whenever a step does not (any
    other forward may change what the blocks mirror). The buffers themselves are kept for the next
    batch that fits them."""

    def __init__(self, max_bytes: int = DENSE_KV_MAX_BYTES, headroom: int = DENSE_KV_HEADROOM) -> None:
        self.max_bytes = max_bytes
        self.headroom = headroom
        self._pool: TokenToKVPool | None = None
        self._keys: list[torch.Tensor] = []  # per layer [rows, capacity, kv_heads, head_dim]
        self._values: list[torch.Tensor] = []
        # What the blocks hold after the last step: its request rows, lengths and slots [bs, max_len]
        # (rows None: nothing, the next step gathers).
        self._rows: list[int] | None = None
        self._seq_lens: list[int] = []
        self._slots: torch.Tensor | None = None

    def drop(self) -> None:
        """Forget what the blocks hold (the next step that uses them gathers)."""
        self._rows = None
        self._slots = None

    def plan(self, batch: ForwardBatch, slots: torch.Tensor) -> DenseStep | None:
        """This decode step's use of the blocks, given its slots [bs, max_len] (padding 0), or None
        (and the blocks dropped) when the batch does not fit in DENSE_KV_MAX_BYTES or sends a request
        in more than one row (speculative verification sends one row per token). CPU pools only: on
        CUDA this backend is the triton kernels' reference and keeps its plain gather (the checks
        here would each wait for the device)."""
        pool = batch.token_to_kv_pool
        if pool.device.type != "cpu":
            self._release()
            return None
        rows = batch.req_pool_indices.tolist()
        seq_lens = list(batch.seq_lens_cpu)
        bs, max_len = slots.shape
        capacity = (max_len // self.headroom + 2) * self.headroom
        per_token = pool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
        if len(set(rows)) != bs or bs * capacity * per_token > self.max_bytes:
            self._release()
            return None
        if self._holds_all_but_the_new_tokens(pool, rows, seq_lens, slots):
            cap = self._keys[0].shape[1]
            # Request b's new token (position seq_len - 1) goes to row b * capacity + seq_len - 1.
            new_rows = torch.arange(bs, device=slots.device) * cap + batch.seq_lens - 1
            step = DenseStep(self._views(self._keys, bs), self._views(self._values, bs), None, new_rows)
        else:
            if not self._keys or self._pool is not pool or self._keys[0].shape[0] < bs or self._keys[0].shape[1] < max_len:
                self._allocate(pool, bs, capacity)
            cap = self._keys[0].shape[1]
            padded = torch.zeros((bs, cap), dtype=slots.dtype, device=slots.device)
            padded[:, :max_len] = slots
            step = DenseStep(self._views(self._keys, bs), self._views(self._values, bs), padded.view(-1), None)
        self._rows, self._seq_lens, self._slots = rows, seq_lens, slots
        return step

    def _holds_all_but_the_new_tokens(
        self, pool: TokenToKVPool, rows: list[int], seq_lens: list[int], slots: torch.Tensor
    ) -> bool:
        """Whether the blocks hold every key of this step but its new ones: the same requests in the
        same order, each one token longer than at the last step, whose earlier positions still map to
        the same slots (a slot's K/V only changes when it is freed and taken again, and any forward
        other than these decode steps drops the blocks)."""
        old = self._slots
        if self._rows != rows or old is None or self._pool is not pool or max(seq_lens) > self._keys[0].shape[1]:
            return False
        if any(new != prev + 1 for new, prev in zip(seq_lens, self._seq_lens)):
            return False
        earlier = slots[:, : old.shape[1]]
        if min(self._seq_lens) != old.shape[1]:
            # The last step read slot 0 past each request's length; this one has one more real slot.
            key_pos = torch.arange(old.shape[1], device=slots.device)
            old_lens = torch.tensor(self._seq_lens, device=slots.device)
            earlier = earlier.masked_fill(key_pos[None, :] >= old_lens[:, None], 0)
        return torch.equal(earlier, old)

    def _allocate(self, pool: TokenToKVPool, bs: int, capacity: int) -> None:
        self._release()  # the old blocks go before the new ones come
        shape = (bs, capacity, pool.num_kv_heads, pool.head_dim)
        self._pool = pool
        self._keys = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        self._values = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]

    def _release(self) -> None:
        self.drop()
        self._pool = None
        self._keys, self._values = [], []

    @staticmethod
    def _views(blocks: list[torch.Tensor], bs: int) -> list[torch.Tensor]:
        return blocks if blocks[0].shape[0] == bs else [block[:bs] for block in blocks]
