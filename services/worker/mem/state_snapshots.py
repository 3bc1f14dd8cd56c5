"""Snapshot memory of the hybrid prefix cache: copies of linear-attention state kept at radix nodes.

HybridRadixCache (mem/hybrid_radix_cache.py) keeps, at some nodes of the tree, the state a linear layer
had after the node's whole path, so a later request with that prefix resumes from it instead of
prefilling the prefix again. StateSnapshots holds that state memory: `total` slots, each the size of
one request's state over all linear layers (the conv window and the delta rule's state, the same
shapes and dtypes as a StatePool row), and the two copies the cache calls:

- copy_state(req_row, slot): the state of request row `req_row` into snapshot slot `slot`;
- restore_state(slot, req_row): the other way, before a matched request's first extend.

Both are queued on the current stream, where the forwards run: a copy taken after a forward sees
what it wrote, and a restore lands before the forward that reads it, also under the overlap schedule
(a copy the host issues while a step is in flight is ordered after that step on the device).

Tracking (StateTrack): the forward that ends a request's prefill also writes the state one token short
of its end into a snapshot slot (HybridRadixCache.track_state), since an identical prompt's match ends
there. Each linear layer runs the chunked rule with that last token's write and decay zeroed (g = 0,
beta = 0: the token leaves the state as it is), saves the state and the conv window before the token,
then the one-token update finishes the sequence and gives the token's output.

The slots are sized from the memory budget beside the state pool's rows (SNAPSHOT_SHARE), or set
with --hybrid-snapshot-slots; their bytes come out of the budget before the KV pool's.
"""

from __future__ import annotations

import torch

from services.worker.mem.hybrid_radix_cache import SnapshotSlots
from services.worker.mem.state_pool import HybridReqToTokenPool, StateShape, StateTrack

# Snapshot slots take this share of the memory budget left after the state pool's rows (SGLang sizes its
# mamba cache from a ratio of the budget too): 0.2 keeps most of it for the KV pool.
SNAPSHOT_SHARE = 0.2
# Without a budget (max_total_tokens fixes the KV pool): this many snapshot slots per request row.
SNAPSHOTS_PER_ROW = 2


def snapshot_slots_for_budget(shape: StateShape, budget: int, max_slots: int) -> int:
    """Snapshot slots that fit SNAPSHOT_SHARE of `budget` bytes, at most max_slots (more than the KV
    pool's tokens would never be used: each snapshot sits at its own node of at least one token)."""
    return max(0, min(max_slots, int(budget * SNAPSHOT_SHARE) // shape.bytes_per_row()))


class StateSnapshots:
    """`total` snapshot slots of every linear layer's state, and their free list (`slots`)."""

    def __init__(self, total: int, req_to_token_pool: HybridReqToTokenPool) -> None:
        self.slots = SnapshotSlots(total)
        self.req_to_token_pool = req_to_token_pool
        pool = req_to_token_pool.state_pool
        shape = pool.shape
        conv = (total, shape.conv_dim, shape.conv_width - 1)
        recurrent = (total, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
        self.conv_state = [
            torch.empty(conv, dtype=shape.conv_dtype, device=pool.device) for _ in range(shape.num_layers)
        ]
        self.recurrent_state = [
            torch.empty(recurrent, dtype=torch.float32, device=pool.device) for _ in range(shape.num_layers)
        ]

    @property
    def total(self) -> int:
        return self.slots.total

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv_state, *self.recurrent_state))

    def copy_state(self, req_row: int, slot: int) -> None:
        """Snapshot request row `req_row`'s state (every linear layer) into `slot`."""
        row = self._state_row(req_row)
        pool = self.req_to_token_pool.state_pool
        for i in range(pool.shape.num_layers):
            self.conv_state[i][slot].copy_(pool.conv_state[i][row])
            self.recurrent_state[i][slot].copy_(pool.recurrent_state[i][row])

    def restore_state(self, slot: int, req_row: int) -> None:
        """Overwrite request row `req_row`'s state (every linear layer) with snapshot `slot`."""
        row = self._state_row(req_row)
        pool = self.req_to_token_pool.state_pool
        for i in range(pool.shape.num_layers):
            pool.conv_state[i][row].copy_(self.conv_state[i][slot])
            pool.recurrent_state[i][row].copy_(self.recurrent_state[i][slot])

    def _state_row(self, req_row: int) -> int:
        return self.req_to_token_pool.state_row(req_row)

    def track(
        self,
        seq_slots: list[tuple[int, int]],
        extend_lens: list[int],
        prefix_lens: list[int],
        device: torch.device,
    ) -> StateTrack:
        """A step's StateTrack: sequence i of the batch (of extend_lens[i] tokens after prefix_lens[i])
        saves its state one token short of its end into slot s, for each (i, s) of seq_slots."""
        width = self.req_to_token_pool.state_pool.shape.conv_width
        starts = [0]
        for n in extend_lens:
            starts.append(starts[-1] + n)
        rows = []
        for seq, slot in seq_slots:
            n = extend_lens[seq]
            if n < 2:
                raise ValueError(f"sequence {seq} has {n} token(s): nothing to track short of its end")
            # The conv window before the last token: inputs n-W .. n-2 of the extend; those before its
            # first token are columns of the window it started from (W-1 + index), zero without one.
            rel = range(n - width, n - 1)
            x_rows = [starts[seq] + r if r >= 0 else -1 for r in rel]
            prev_cols = [width - 1 + r if r < 0 else -1 for r in rel]
            rows.append([seq, starts[seq + 1] - 1, slot, int(prefix_lens[seq] > 0), *x_rows, *prev_cols])
        packed = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        k = width - 1
        return StateTrack(
            conv_snapshots=self.conv_state,
            recurrent_snapshots=self.recurrent_state,
            seqs=packed[:, 0],
            last_rows=packed[:, 1],
            slots=packed[:, 2],
            has_initial_state=packed[:, 3].bool(),
            window_x_rows=packed[:, 4 : 4 + k],
            window_prev_cols=packed[:, 4 + k : 4 + 2 * k],
        )
