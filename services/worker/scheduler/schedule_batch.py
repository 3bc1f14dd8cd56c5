"""ScheduleBatch: the scheduler's CPU view of one step — which requests run, what KV they get —
turned into the device-side ForwardBatch the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.forward_batch import ForwardBatch, ForwardMode
from services.worker.scheduler.req import Req

if TYPE_CHECKING:
    from services.worker.attention.base import AttentionBackend
    from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
    from services.worker.mem.radix_cache import RadixCache
    from services.worker.model_runner import FutureTokens


class OutOfKVSlots(RuntimeError):
    """The allocator could not hand out the slots a step needs even after eviction."""


@dataclass
class MemoryContext:
    """The pools and cache a batch draws on (one set per worker)."""

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    allocator: TokenToKVPoolAllocator
    tree_cache: RadixCache
    attn_backend: AttentionBackend
    device: torch.device

    def alloc_slots(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree_cache.evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        if slots is None:
            raise OutOfKVSlots(f"need {n} KV slots, {self.allocator.available_size()} free after eviction")
        return slots


class ScheduleBatch:
    """Requests of one step: EXTEND (prefill chunks, optionally with decodes as 1-token extends) or
    DECODE."""

    def __init__(self, reqs: list[Req], mode: ForwardMode, mem: MemoryContext) -> None:
        self.reqs = reqs
        self.mode = mode
        self.mem = mem

    def prepare_extend(self) -> ForwardBatch:
        """Give each request a req_to_token row, map its cached prefix, and allocate KV for its
        new tokens (req.fill_ids[len(prefix):])."""
        mem = self.mem
        for req in self.reqs:
            if req.req_pool_idx is None:
                rows = mem.req_to_token_pool.alloc(1)
                if rows is None:
                    raise OutOfKVSlots("no free request rows")
                req.req_pool_idx = rows[0]
            prefix_len = len(req.prefix_indices)
            if req.kv_committed_len < prefix_len:
                mem.req_to_token_pool.write(
                    req.req_pool_idx, req.kv_committed_len, req.prefix_indices[req.kv_committed_len :]
                )
                req.kv_committed_len = prefix_len
        prefix_lens = [req.kv_committed_len for req in self.reqs]
        extend_lens = [len(req.fill_ids) - p for req, p in zip(self.reqs, prefix_lens)]
        slots = mem.alloc_slots(sum(extend_lens))
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        start = 0
        for req, prefix_len, n in zip(self.reqs, prefix_lens, extend_lens):
            mem.req_to_token_pool.write(req.req_pool_idx, prefix_len, slots[start : start + n])
            input_ids.extend(req.fill_ids[prefix_len:])
            positions.append(torch.arange(prefix_len, prefix_len + n, dtype=torch.int64))
            start += n
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        return self._forward_batch(
            ForwardMode.EXTEND, input_ids, torch.cat(positions), slots, seq_lens, prefix_lens, extend_lens
        )

    def prepare_decode(self, future: FutureTokens | None = None) -> ForwardBatch:
        """One new slot per request for the token sampled last step. With overlap, requests whose
        last token is still in flight read it from `future` (that step's device token ids)."""
        mem = self.mem
        slots = mem.alloc_slots(len(self.reqs))
        prefix_lens = [req.kv_committed_len for req in self.reqs]
        for req, slot in zip(self.reqs, slots):
            mem.req_to_token_pool.write(req.req_pool_idx, req.kv_committed_len, slot.view(1))
        input_ids = [req.output_ids[-1] if req.output_ids else 0 for req in self.reqs]
        positions = torch.tensor(prefix_lens, dtype=torch.int64)
        seq_lens = [p + 1 for p in prefix_lens]
        batch = self._forward_batch(
            ForwardMode.DECODE, input_ids, positions, slots, seq_lens, prefix_lens, [1] * len(self.reqs)
        )
        if future is not None:
            tokens, rows = future
            index = [rows.get(id(req), -1) if req.num_inflight else -1 for req in self.reqs]
            if any(i >= 0 for i in index):
                idx = torch.tensor(index, dtype=torch.int64).to(mem.device, non_blocking=True)
                batch.input_ids = torch.where(idx >= 0, tokens[idx.clamp(min=0)], batch.input_ids)
        return batch

    def commit(self, batch: ForwardBatch) -> None:
        """After the forward: the new tokens' KV is resident."""
        for req, seq_len in zip(self.reqs, batch.seq_lens_cpu):
            req.kv_committed_len = seq_len

    def _forward_batch(
        self,
        mode: ForwardMode,
        input_ids: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
    ) -> ForwardBatch:
        mem = self.mem
        dev = mem.device
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(self.reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64).to(
                dev, non_blocking=True
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(dev, non_blocking=True),
            out_cache_loc=slots.to(dev, non_blocking=True),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=mem.req_to_token_pool,
            token_to_kv_pool=mem.token_to_kv_pool,
            attn_backend=mem.attn_backend,
        )
        return batch
