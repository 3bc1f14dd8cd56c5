"""ScheduleBatch: the scheduler's CPU view of one step — which requests run, what KV they get —
turned into the device-side ForwardBatch the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.step_inputs import apply_step_inputs, step_kernels_enabled
from services.worker.mem.hybrid_radix_cache import HybridRadixCache
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode
from services.worker.runtime.model_runner import prompt_logprobs
from services.worker.runtime.sampling.penalties import to_device_async
from services.worker.scheduler.req import Req

# Prompt log-probs of a step: each prompt row's value, and its top log-probs when asked (model_runner.prompt_logprobs).
PromptLogprobs = tuple[list[float], list[list[tuple[int, float]]] | None]

if TYPE_CHECKING:
    from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
    from services.worker.mem.radix_cache import RadixCache
    from services.worker.runtime.attention.base import AttentionBackend
    from services.worker.runtime.model_runner import FutureTokens, PendingSample, SampledOnLastStage


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
        # Set by prepare_extend for requests asking for prompt log-probs: each one's number of prompt
        # rows this step (in batch order), and the token each row's logits score (the next one).
        self.prompt_logprob_counts: list[tuple[Req, int]] = []
        self.prompt_logprob_targets: list[int] = []

    def split(self, parts: int) -> list[ScheduleBatch]:
        """The batch as up to `parts` batches of consecutive requests (pipeline micro-batches), sized as
        evenly as the request count allows; a batch of one request stays whole."""
        parts = max(1, min(parts, len(self.reqs)))
        if parts == 1:
            return [self]
        base, extra = divmod(len(self.reqs), parts)
        bounds = [0]
        for k in range(parts):
            bounds.append(bounds[-1] + base + (1 if k < extra else 0))
        return [ScheduleBatch(self.reqs[a:b], self.mode, self.mem) for a, b in zip(bounds, bounds[1:])]

    def sampled_rows(self) -> list[int]:
        """The requests that get a token from this step, by index: all of a decode, and those of an
        extend whose prefill completes (a chunk that leaves prompt tokens for later samples nothing)."""
        return [i for i, req in enumerate(self.reqs) if self.mode.is_decode() or len(req.fill_ids) == req.seq_len]

    def prepare_extend(self) -> ForwardBatch:
        """Give each request a req_to_token row, map its cached prefix, and allocate KV for its
        new tokens (req.fill_ids[len(prefix):])."""
        mem = self.mem
        writes = _SlotWrites()
        for req in self.reqs:
            if req.req_pool_idx is None:
                rows = mem.req_to_token_pool.alloc(1)
                if rows is None:
                    raise OutOfKVSlots("no free request rows")
                req.req_pool_idx = rows[0]
                if isinstance(mem.tree_cache, HybridRadixCache):
                    # The linear layers resume from the snapshot at the prefix's end; with no prefix
                    # the row keeps the zero state it was allocated with.
                    mem.tree_cache.restore_prefix_state(req)
            prefix_len = len(req.prefix_indices)
            if req.kv_committed_len < prefix_len:
                writes.add(req.req_pool_idx, req.kv_committed_len, req.prefix_indices[req.kv_committed_len :])
                req.kv_committed_len = prefix_len
        prefix_lens = [req.kv_committed_len for req in self.reqs]
        extend_lens = [len(req.fill_ids) - p for req, p in zip(self.reqs, prefix_lens)]
        slots = mem.alloc_slots(sum(extend_lens))
        input_ids: list[int] = []
        prompt_rows: list[int] = []
        start = 0
        for req, prefix_len, n in zip(self.reqs, prefix_lens, extend_lens):
            writes.add(req.req_pool_idx, prefix_len, slots[start : start + n])
            input_ids.extend(req.fill_ids[prefix_len:])
            span = req.prompt_logprob_span(prefix_len, prefix_len + n)
            if span:
                prompt_rows.extend(range(start + span.start - prefix_len, start + span.stop - prefix_len))
                self.prompt_logprob_counts.append((req, len(span)))
                self.prompt_logprob_targets.extend(req.origin_input_ids[span.start + 1 : span.stop + 1])
            start += n
        lens = torch.tensor(extend_lens, dtype=torch.int64)
        offsets = torch.repeat_interleave(torch.tensor(prefix_lens, dtype=torch.int64) - (lens.cumsum(0) - lens), lens)
        positions = torch.arange(int(lens.sum()), dtype=torch.int64) + offsets
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        batch = self._forward_batch(
            ForwardMode.EXTEND, input_ids, positions, slots, seq_lens, prefix_lens, extend_lens, writes
        )
        if prompt_rows:
            batch.prompt_logit_rows = to_device_async(torch.tensor(prompt_rows, dtype=torch.int64), mem.device)
        if isinstance(mem.tree_cache, HybridRadixCache):
            batch.state_track = self._track_states(mem.tree_cache, extend_lens)
        return batch

    def _track_states(self, cache: HybridRadixCache, extend_lens: list[int]) -> list[tuple[int, int]]:
        """A hybrid model's requests whose prefill this step ends (two tokens or more) also save their
        state one token short of the end, where an identical prompt's match ends (track_state): (index,
        snapshot slot) of each that got a slot."""
        tracked = []
        for i, (req, n) in enumerate(zip(self.reqs, extend_lens)):
            if n >= 2 and len(req.fill_ids) == req.seq_len:
                slot = cache.track_state(req, len(req.fill_ids) - 1)
                if slot is not None:
                    tracked.append((i, slot))
        return tracked

    def prepare_decode(self, future: FutureTokens | None = None) -> ForwardBatch:
        """One new slot per request for the token sampled last step. With overlap, requests whose
        last token is still in flight read it from `future` (that step's device token ids)."""
        mem = self.mem
        slots = mem.alloc_slots(len(self.reqs))
        prefix_lens = [req.kv_committed_len for req in self.reqs]
        positions = torch.tensor(prefix_lens, dtype=torch.int64)
        writes = _SlotWrites()
        writes.add_flat(torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64), positions, slots)
        input_ids = [req.output_ids[-1] if req.output_ids else 0 for req in self.reqs]
        seq_lens = [p + 1 for p in prefix_lens]
        future_index = None
        if future is not None:
            tokens, rows = future
            index = [rows.get(id(req), -1) if req.num_inflight else -1 for req in self.reqs]
            if any(i >= 0 for i in index):
                future_index = (tokens, index)
        return self._forward_batch(
            ForwardMode.DECODE, input_ids, positions, slots, seq_lens, prefix_lens, [1] * len(self.reqs),
            writes, future_index,
        )

    def prepare_rows(self, future_index: tuple[torch.Tensor, list[int]] | None = None) -> ForwardBatch:
        """Every request's new tokens (fill_ids past kv_committed_len) as DECODE rows, one per token.

        Row j of a request sits at position kv_committed_len + j and attends to the request's first
        kv_committed_len + j + 1 tokens: all rows store their KV before any attends, and the later
        rows lie past its length, so the decode kernels compute exactly the causal attention of an
        EXTEND over those tokens, and the step can replay a decode CUDA graph (an EXTEND step runs
        eagerly). Speculative verification checks its k + 1 tokens per request this way. Logits come
        back for every row; the caller commits each request's KV itself. `future_index` (device
        tokens, one index per row or -1) takes rows' input ids from the device instead of fill_ids."""
        mem = self.mem
        counts = [len(req.fill_ids) - req.kv_committed_len for req in self.reqs]
        slots = mem.alloc_slots(sum(counts))
        input_ids: list[int] = []
        positions: list[int] = []
        pool_rows: list[int] = []
        for req, n in zip(self.reqs, counts):
            assert req.req_pool_idx is not None, "rows extend requests that already hold a request row"
            start = req.kv_committed_len
            input_ids.extend(req.fill_ids[start:])
            positions.extend(range(start, start + n))
            pool_rows.extend([req.req_pool_idx] * n)
        position_t = torch.tensor(positions, dtype=torch.int64)
        writes = _SlotWrites()
        writes.add_flat(torch.tensor(pool_rows, dtype=torch.int64), position_t, slots)
        return self._forward_batch(
            ForwardMode.DECODE, input_ids, position_t, slots, [p + 1 for p in positions], positions,
            [1] * len(positions), writes, future_index=future_index, pool_rows=pool_rows,
        )

    def commit(
        self, batch: ForwardBatch, logits: torch.Tensor | None = None, prompt: PromptLogprobs | None = None
    ) -> None:
        """After the forward: the new tokens' KV is resident, and requests asking for prompt log-probs
        keep those of this step's prompt rows (the rows of `logits` past the first len(reqs)), or
        `prompt`, those log-probs as prompt_logprobs_of gave them on another rank (pipeline stages)."""
        for req, seq_len in zip(self.reqs, batch.seq_lens_cpu):
            req.kv_committed_len = seq_len
        if not self.prompt_logprob_counts:
            return
        if prompt is None:
            assert logits is not None, "an extend step with prompt log-probs commits with its logits"
            prompt = self.prompt_logprobs_of(logits)
        assert prompt is not None
        values, top = prompt
        start = 0
        for req, count in self.prompt_logprob_counts:
            req.input_logprobs.extend(values[start : start + count])
            if req.top_logprobs_num and top is not None:
                req.input_top_logprobs.extend(row[: req.top_logprobs_num] for row in top[start : start + count])
            start += count

    def prompt_logprobs_of(self, logits: torch.Tensor) -> PromptLogprobs | None:
        """This step's prompt log-probs (and top log-probs) from its logits; None when none asked."""
        if not self.prompt_logprob_counts:
            return None
        top_n = max(req.top_logprobs_num for req, _ in self.prompt_logprob_counts)
        return prompt_logprobs(logits[len(self.reqs) :], self.prompt_logprob_targets, top_n)

    def _forward_batch(
        self,
        mode: ForwardMode,
        input_ids: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        writes: _SlotWrites,
        future_index: tuple[torch.Tensor, list[int]] | None = None,
        pool_rows: list[int] | None = None,
    ) -> ForwardBatch:
        """Everything the device needs for the step goes over in one (pinned) copy; a pageable
        copy would make the host wait for the step in flight and undo overlap scheduling. The
        batch has one row per request unless `pool_rows` gives each row's request row."""
        mem = self.mem
        if pool_rows is None:
            pool_rows = [r.req_pool_idx for r in self.reqs]
        bs, n = len(pool_rows), len(input_ids)
        rows, cols, values = writes.flat()
        mem.req_to_token_pool.write_cpu(rows, cols, values)
        parts = [
            torch.tensor(input_ids, dtype=torch.int64),
            positions,
            torch.tensor(pool_rows, dtype=torch.int64),
            torch.tensor(seq_lens, dtype=torch.int64),
            slots,
        ]
        if future_index is not None:
            parts.append(torch.tensor(future_index[1], dtype=torch.int64))
        on_device = mem.req_to_token_pool.device.type != "cpu"
        if on_device:
            parts += [rows, cols, values]
        packed = to_device_async(torch.cat(parts), mem.device)
        sizes = [n, n, bs, bs, n] + ([bs] if future_index is not None else []) + (
            [rows.numel()] * 3 if on_device else []
        )
        pieces = list(packed.split(sizes))
        input_ids_d, positions_d, pool_idx_d, seq_lens_d, slots_d = pieces[:5]
        rest = pieces[5:]
        # The tokens still in flight resolve in place (input_ids_d stays the packed block's first row).
        if step_kernels_enabled(packed.device):
            index_start = sum(sizes[:5]) if future_index is not None else -1
            tokens = future_index[0] if future_index is not None else None
            n_writes = rows.numel()  # a CUDA table: on_device
            table = mem.req_to_token_pool.req_to_token
            apply_step_inputs(packed, tokens, index_start, n, table, packed.numel() - 3 * n_writes, n_writes)
        else:
            if future_index is not None:
                idx = rest.pop(0)
                tokens = future_index[0]
                torch.where(idx >= 0, tokens[idx.clamp(min=0)], input_ids_d, out=input_ids_d)
            if on_device:
                mem.req_to_token_pool.write_device(*rest)
        # With one token per request, input ids .. slots are 5 * bs consecutive values: one block.
        packed_rows = packed[: 5 * bs].view(5, bs) if n == bs else None
        return ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=input_ids_d,
            positions=positions_d,
            req_pool_indices=pool_idx_d,
            seq_lens=seq_lens_d,
            out_cache_loc=slots_d,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=mem.req_to_token_pool,
            token_to_kv_pool=mem.token_to_kv_pool,
            attn_backend=mem.attn_backend,
            packed_rows=packed_rows,
        )


class _SlotWrites:
    """req_to_token entries a step sets, gathered so they are applied in one go."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._cols: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def add(self, row: int, start: int, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._rows.append(torch.full((n,), row, dtype=torch.int64))
        self._cols.append(torch.arange(start, start + n, dtype=torch.int64))
        self._values.append(slots)

    def add_flat(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        self._rows.append(rows)
        self._cols.append(cols)
        self._values.append(slots)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._rows:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, empty
        return torch.cat(self._rows), torch.cat(self._cols), torch.cat(self._values).to(torch.int64)


@dataclass
class InFlight:
    """A launched step whose sampled tokens are not read back yet."""

    batch: ScheduleBatch
    sampled: list[Req]  # requests that get a token from this step, in row order
    handle: PendingSample | SampledOnLastStage
