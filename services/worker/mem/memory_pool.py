"""KV memory: ReqToTokenPool (request position -> KV slot), TokenToKVPool (K and V per layer) and the
slot allocator.

Slot 0 of the KV pool is never handed out: padded rows (CUDA-graph padding) write their KV there.
So a pool of `size` usable slots has `size + 1` rows.
"""

from __future__ import annotations

import math
import mmap

import torch


class ReqToTokenPool:
    """req_to_token[r, p] is the KV slot holding position p of the request in row r.

    The device table is what attention kernels read; a CPU mirror serves the scheduler and the radix
    cache, so bookkeeping never waits on the device (on a CPU device they are one tensor).
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._cpu = (
            self.req_to_token
            if self.device.type == "cpu"
            else torch.zeros((size, max_context_len), dtype=torch.int32)
        )
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        return rows

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Map positions start .. start+len(slots)-1 of `row` to `slots` (a CPU tensor)."""
        end = start + slots.numel()
        self._cpu[row, start:end] = slots
        if self._cpu is not self.req_to_token:
            self.req_to_token[row, start:end] = slots.to(self.device, torch.int32, non_blocking=True)

    def write_cpu(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """Set entries (rows[i], cols[i]) = slots[i] in the host table (the whole table on a CPU
        device); `write_device` applies the same entries to a device table."""
        if rows.numel():
            self._cpu[rows, cols] = slots.to(torch.int32)

    def write_device(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        if rows.numel() and self._cpu is not self.req_to_token:
            self.req_to_token[rows, cols] = slots.to(torch.int32)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """KV slots of positions start .. end-1 of `row`, as an int64 CPU tensor."""
        return self._cpu[row, start:end].to(torch.int64)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class TokenToKVPool:
    """K and V buffers per layer: [size + 1, num_kv_heads, head_dim] each (row 0 is padding)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        commit_at_start: bool = True,
    ) -> None:
        """commit_at_start False (a CPU pool sized from free memory): the buffers take memory as their
        slots are first written, not at start."""
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        zeros = torch.zeros if commit_at_start else _zeros_on_first_touch
        self.k_buffer = [zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, num_kv_heads, head_dim] (or flattened heads) written at slots `loc`."""
        self.k_buffer[layer_id][loc] = k.view(-1, self.num_kv_heads, self.head_dim).to(self.dtype)
        self.v_buffer[layer_id][loc] = v.view(-1, self.num_kv_heads, self.head_dim).to(self.dtype)


def _zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on CPU in fresh anonymous memory: the kernel gives zero-filled pages on first
    write, so the buffer costs nothing until its slots are used. torch.zeros writes every byte at once:
    a CPU pool sized from free memory (a quarter of it, 5.2 GB on a 23 GB machine) took 10 s of CPU at
    every worker's start on a small VM, for slots most runs never use."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size one token at a time (page size 1)."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        # Kept on the CPU: allocation is bookkeeping; the slot ids go to the device with the batch.
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64, CPU), or None when fewer than n are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            slots = slots.to("cpu", torch.int64)
            # Slot 0 is the padding row (unwritten req_to_token entries read as 0): never free it.
            self._free = torch.cat((self._free, slots[slots != 0]))
