"""KV memory: ReqToTokenPool (request position -> KV slot), TokenToKVPool (K and V per layer) and the
slot allocator.

Slot 0 of the KV pool is never handed out: padded rows (CUDA-graph padding) write their KV there.
So a pool of `size` usable slots has `size + 1` rows.

FP8 KV cache (`kv_cache_dtype` fp8_e4m3 or fp8_e5m2): the pool stores K and V as float8, one byte an
element, so at equal memory it holds twice the tokens of a bfloat16 pool. Each layer has a per-tensor
scale for K and one for V (1.0 unless the checkpoint gives them, as in SGLang and vLLM): a value x is
stored as fp8(clamp(x / scale, -max, max)) (round to nearest even; max is 448 for e4m3, 57344 for e5m2)
and read back as stored * scale. With scale 1.0, e4m3 keeps 3 mantissa bits: every stored value is
within 2^-4 (6.25 %) of x relative, values below 2^-6 keep less (subnormals, down to 2^-9) and
|x| > 448 is clipped; e5m2 keeps 2 bits (12.5 %) over a wider range. Every reader (attention backends,
kernels) sees only the stored values, also for the new tokens of the step that stores them, so a
request's attention is the same whether its prefix came from the radix cache, an earlier chunk or this
step.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from kernels.cpu_matvec import row_ops

# kv_cache_dtype names (SGLang's and vLLM's spellings) of the float8 storage types.
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_storage_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's for 'auto' (or None), else the named float8 type."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, {', '.join(FP8_KV_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: cast to `dtype`, and for float8 first divided by `scale` (a multiply by
    its float32 reciprocal, as the kernels do) and clipped to the type's finite range."""
    if not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-top, top).to(dtype)


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
    """K and V buffers per layer: [size + 1, num_kv_heads, head_dim] each (row 0 is padding). A float8
    pool also has each layer's K and V scale (k_scales, v_scales): stored values times the scale are
    the keys and values attention uses."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        commit_at_start: bool = True,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        """commit_at_start False (a CPU pool sized from free memory): the buffers take memory as their
        slots are first written, not at start. k_scales / v_scales: one per layer (default 1.0), float8
        dtypes only."""
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is None:
                continue
            if not is_fp8(dtype):
                raise ValueError(f"{name}: KV scales apply to a float8 pool only, not to {dtype}")
            if len(scales) != num_layers or not all(math.isfinite(s) and s > 0 for s in scales):
                raise ValueError(f"{name}: expected {num_layers} finite positive scales, got {list(scales)}")
        self.k_scales = [float(s) for s in k_scales] if k_scales is not None else [1.0] * num_layers
        self.v_scales = [float(s) for s in v_scales] if v_scales is not None else [1.0] * num_layers
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
        if (
            self.dtype == torch.float32
            and self.device.type == "cpu"
            and store_rows(k, v, self.k_buffer[layer_id], self.v_buffer[layer_id], loc)
        ):
            return
        self.k_buffer[layer_id][loc] = self.quantize_k(layer_id, k.view(-1, self.num_kv_heads, self.head_dim))
        self.v_buffer[layer_id][loc] = self.quantize_v(layer_id, v.view(-1, self.num_kv_heads, self.head_dim))

    def quantize_k(self, layer_id: int, k: torch.Tensor) -> torch.Tensor:
        """k as layer `layer_id`'s pool stores it (see quantize_kv)."""
        return quantize_kv(k, self.k_scales[layer_id], self.dtype)

    def quantize_v(self, layer_id: int, v: torch.Tensor) -> torch.Tensor:
        return quantize_kv(v, self.v_scales[layer_id], self.dtype)


def store_rows(
    k: torch.Tensor, v: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor
) -> bool:
    """k_dst[rows] = k and v_dst[rows] = v in one C++ call (kernels/cpu/rows.cpp, for float32 CPU tensors
    with contiguous rows: two torch index_puts cost ~10 us each at batch 16), and True; False where that
    op does not apply (the caller stores with torch)."""
    ops = row_ops()
    if ops is None or k.dtype != torch.float32 or v.dtype != torch.float32 or rows.dtype != torch.int64:
        return False
    if k.device.type != "cpu" or k_dst.dtype != torch.float32 or rows.dim() != 1:
        return False
    k2, v2 = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    if k2.stride(-1) != 1 or v2.stride(-1) != 1:
        return False
    ops.store_kv_rows_(k2, v2, k_dst, v_dst, rows)
    return True


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
