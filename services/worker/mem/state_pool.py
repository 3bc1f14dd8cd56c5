"""State memory of hybrid models: the fixed-size state each linear-attention (Gated DeltaNet) layer
keeps per request, beside the KV pool that the full-attention layers use.

StatePool holds, per linear layer, the causal conv1d's last W-1 inputs ([rows, conv_dim, W-1], the
model's dtype) and the delta rule's state ([rows, Hv, Dk, Dv], float32). Row 0 is never handed out:
padded batch rows (CUDA-graph padding) read and write there, as padded tokens use KV slot 0. So a pool
of `size` usable rows has `size + 1`.

HybridReqToTokenPool gives every request row of the ReqToTokenPool one state row for its lifetime:
allocated (and zeroed, so a fresh request starts from the empty state) with the request row, freed with
it. Whatever frees a request row (finish, abort, retraction) frees its state, and

    state_pool.available_size() + request rows in use == state_pool.size

holds whenever the ReqToTokenPool's own accounting does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.mem.memory_pool import ReqToTokenPool

# The state pool takes at most this share of the memory budget, so the KV pool keeps the rest.
MAX_STATE_SHARE = 0.5


@dataclass(frozen=True)
class StateShape:
    """The per-request state geometry of the linear-attention layers (this rank's share of the heads)."""

    num_layers: int  # linear-attention layers
    conv_dim: int  # channels of the causal conv1d (q, k and v of the layer)
    conv_width: int  # the conv1d's kernel size W; the state keeps W - 1 inputs
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_dtype: torch.dtype

    def bytes_per_row(self) -> int:
        """Bytes one request's state takes over all linear layers."""
        conv = self.conv_dim * (self.conv_width - 1) * torch.empty((), dtype=self.conv_dtype).element_size()
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_layers * (conv + recurrent)


def state_rows_for_budget(shape: StateShape, budget: int, max_rows: int) -> int:
    """Request rows whose state fits MAX_STATE_SHARE of `budget` bytes (one more row is the padding
    row), at most max_rows; ValueError when not even one fits."""
    rows = min(max_rows, int(budget * MAX_STATE_SHARE) // shape.bytes_per_row() - 1)
    if rows < 1:
        raise ValueError(
            f"not enough memory for the linear-attention state of one request: {shape.bytes_per_row() / 2**20:.1f} "
            f"MiB per request, {budget / 2**20:.1f} MiB budget for all pools"
        )
    return rows


class StatePool:
    """Conv and recurrent state rows 1..size of every linear layer; row 0 is the padding row."""

    PAD_ROW = 0

    def __init__(self, size: int, shape: StateShape, device: torch.device | str) -> None:
        if size < 1:
            raise ValueError(f"the state pool needs at least one row, got {size}")
        self.size = size
        self.shape = shape
        self.device = torch.device(device)
        conv = (size + 1, shape.conv_dim, shape.conv_width - 1)
        recurrent = (size + 1, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
        self.conv_state = [
            torch.zeros(conv, dtype=shape.conv_dtype, device=self.device) for _ in range(shape.num_layers)
        ]
        self.recurrent_state = [
            torch.zeros(recurrent, dtype=torch.float32, device=self.device) for _ in range(shape.num_layers)
        ]
        self.clear()

    def clear(self) -> None:
        self._free: list[int] = list(range(1, self.size + 1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free row with its state zeroed in every layer, or None when none is free."""
        if not self._free:
            return None
        row = self._free.pop(0)
        for conv, recurrent in zip(self.conv_state, self.recurrent_state):
            conv[row].zero_()
            recurrent[row].zero_()
        return row

    def free(self, row: int) -> None:
        if not 1 <= row <= self.size:
            raise ValueError(f"state row {row} is outside 1..{self.size}")
        self._free.append(row)

    def layer(self, state_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state, recurrent state) pool tensors of linear layer `state_id`."""
        return self.conv_state[state_id], self.recurrent_state[state_id]


@dataclass
class StateTrack:
    """The sequences of a step that save their state one token short of their end, and where to: what
    each linear layer needs for it (mem/state_snapshots.py's module doc; StateSnapshots.track makes it). All tensors on the device, one row each."""

    conv_snapshots: list[torch.Tensor]  # per linear layer: [slots, C, W-1], the snapshot slots' conv windows
    recurrent_snapshots: list[torch.Tensor]  # per linear layer: [slots, Hv, Dk, Dv] float32
    seqs: torch.Tensor  # [F] int64: the sequence's index in the batch
    last_rows: torch.Tensor  # [F] int64: its last token's row in the packed batch
    slots: torch.Tensor  # [F] int64: the snapshot slot it saves into
    has_initial_state: torch.Tensor  # [F] bool: it continues a conv window (else zeros before it)
    window_x_rows: torch.Tensor  # [F, W-1] int64: conv window entries from the extend's inputs (-1: not)
    window_prev_cols: torch.Tensor  # [F, W-1] int64: entries from the window it started from (-1: not)

    def conv_window(
        self, x: torch.Tensor, conv_state: torch.Tensor, state_rows: torch.Tensor
    ) -> torch.Tensor:
        """The conv window [F, C, W-1] before each sequence's last token, from the step's conv input x
        [T, C] and the pool's windows (read before the step's conv overwrites them)."""
        from_x = x[self.window_x_rows.clamp(min=0)].transpose(1, 2).to(conv_state.dtype)
        prev = conv_state[state_rows] * self.has_initial_state[:, None, None].to(conv_state.dtype)
        cols = self.window_prev_cols.clamp(min=0)[:, None, :].expand(-1, prev.shape[1], -1)
        from_prev = prev.gather(2, cols)
        return torch.where((self.window_x_rows >= 0)[:, None, :], from_x, from_prev)

    def save(self, state_id: int, conv_window: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Linear layer state_id's tracked states (conv windows [F, C, W-1], delta-rule states [F, Hv,
        Dk, Dv]) into the sequences' snapshot slots."""
        self.conv_snapshots[state_id][self.slots] = conv_window
        self.recurrent_snapshots[state_id][self.slots] = recurrent.float()


@dataclass
class StateMetadata:
    """A step's view of the state pool, for the linear layers (set on ForwardBatch.state_metadata).

    Sequence i of the batch reads and writes state row state_indices[i]; has_initial_state[i] is False
    for a sequence that starts at position 0 (its conv window begins with zeros); cu_seqlens bounds its
    tokens in the packed batch; `track`, the sequences that also save their state one token short of
    their end (extend steps of a hybrid prefix cache, mem/state_snapshots.py)."""

    state_pool: StatePool
    state_indices: torch.Tensor  # [bs] int64
    has_initial_state: torch.Tensor  # [bs] bool
    cu_seqlens: torch.Tensor  # [bs + 1] int32
    track: StateTrack | None = None


class HybridReqToTokenPool(ReqToTokenPool):
    """A ReqToTokenPool whose rows each own a StatePool row, allocated and freed with them."""

    def __init__(
        self, size: int, max_context_len: int, device: torch.device | str, state_pool: StatePool
    ) -> None:
        if state_pool.size < size:
            raise ValueError(f"the state pool has {state_pool.size} rows for {size} request rows")
        super().__init__(size, max_context_len, device)
        self.state_pool = state_pool
        # Request row -> state row, on the device for the step and on the host for freeing.
        self.req_to_state = torch.full((size,), StatePool.PAD_ROW, dtype=torch.int64, device=self.device)
        self._req_to_state_cpu = [StatePool.PAD_ROW] * size

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > self.state_pool.available_size():
            return None
        rows = super().alloc(n)
        if rows is None:
            return None
        for row in rows:
            state_row = self.state_pool.alloc()
            assert state_row is not None  # checked above
            self._req_to_state_cpu[row] = state_row
            self.req_to_state[row] = state_row
        return rows

    def free(self, row: int) -> None:
        state_row = self._req_to_state_cpu[row]
        if state_row == StatePool.PAD_ROW:
            raise ValueError(f"request row {row} holds no state row (freed twice?)")
        self.state_pool.free(state_row)
        # A free request row maps to the padding row, so nothing that still names it (a padded batch
        # row) reaches the state row's next owner.
        self._req_to_state_cpu[row] = StatePool.PAD_ROW
        self.req_to_state[row] = StatePool.PAD_ROW
        super().free(row)

    def state_row(self, row: int) -> int:
        """The state row of request row `row`; ValueError when it holds none (not allocated)."""
        if not 0 <= row < self.size or self._req_to_state_cpu[row] == StatePool.PAD_ROW:
            raise ValueError(f"request row {row} holds no state row")
        return self._req_to_state_cpu[row]

    def clear(self) -> None:
        super().clear()
        self.state_pool.clear()
        self._req_to_state_cpu = [StatePool.PAD_ROW] * self.size
        self.req_to_state.fill_(StatePool.PAD_ROW)

    def check_state_invariant(self, rows_held: int) -> None:
        """free state rows + rows held by `rows_held` requests == all state rows, and each request row in
        use maps to its own state row; AssertionError naming the counts otherwise."""
        mapped = [r for r in self._req_to_state_cpu if r != StatePool.PAD_ROW]
        free, size = self.state_pool.available_size(), self.state_pool.size
        if free + rows_held != size or len(mapped) != rows_held or len(set(mapped)) != len(mapped):
            raise AssertionError(
                f"state pool leak: free {free} + held by requests {rows_held} != {size} "
                f"(request rows mapped to state rows: {len(mapped)}, distinct: {len(set(mapped))})"
            )

    def state_metadata(
        self, req_pool_indices: torch.Tensor, extend_seq_lens: list[int], extend_prefix_lens: list[int]
    ) -> StateMetadata:
        """A step's StateMetadata: each request's state row (from its request row, on the device),
        whether it continues a state (a chunked prefill's later chunk, a decode), its token bounds."""
        lens = torch.tensor(extend_seq_lens, dtype=torch.int32)
        cu = torch.zeros(len(extend_seq_lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        initial = torch.tensor([p > 0 for p in extend_prefix_lens], dtype=torch.bool)
        device = req_pool_indices.device
        return StateMetadata(
            state_pool=self.state_pool,
            state_indices=self.req_to_state[req_pool_indices],
            has_initial_state=initial.to(device, non_blocking=True),
            cu_seqlens=cu.to(device, non_blocking=True),
        )
