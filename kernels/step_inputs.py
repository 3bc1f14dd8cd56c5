"""A step's device-side input fixups in one launch: tokens still in flight, and the request table's new slots.

Each step's inputs reach the device in one pinned copy (ScheduleBatch._forward_batch packs them). Two things
are then left to do on the device before the forward can run:
- with overlap scheduling a decode row's input token may be the one the step still in flight samples: the
  packed copy holds an index into that step's device token ids (or -1: the host already knows the token);
- the request-to-token table gets the step's new KV slots (rows, columns, values, packed too).
In torch that is six small launches (the index's >= 0 and clamp, the gather, the where, the int32 cast and
the index_put): ~10 µs of a GPU that then sits idle between a batch-1 decode step's graph replays, ~1 % of
a Qwen3-0.6B step. Here one program does both, resolving the input ids in place in the packed buffer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 256
STEP_KERNELS_ENV = "RS_STEP_KERNELS"


def step_kernels_enabled(device: torch.device) -> bool:
    """Whether a step on `device` takes these launches (apply_step_inputs, and kernels/sampling.py's
    greedy_argmax for greedy rows): on CUDA unless RS_STEP_KERNELS=0 (A/B runs: bench/gpu_pdl.py --env
    RS_STEP_KERNELS); elsewhere the torch forms run."""
    return device.type == "cuda" and os.environ.get(STEP_KERNELS_ENV, "1") != "0"


# Its sizes and offsets change every step: one compiled kernel for all of them, not one per pattern of
# "equals 1" and "divisible by 16" among them (a compile in the middle of serving takes ~1 s).
@triton.jit(do_not_specialize=["stride_r2t", "n_ids", "index_start", "n_writes", "writes_start"])
def _step_inputs_kernel(
    Packed,
    Tokens,
    Req_to_token,
    stride_r2t,
    n_ids,
    index_start,
    n_writes,
    writes_start,
    BLOCK: tl.constexpr,
):
    # Input ids: packed[i] = tokens[index[i]] where index[i] >= 0 (index_start < 0: no index).
    if index_start >= 0:
        for start in range(0, n_ids, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            index = tl.load(Packed + index_start + offs, mask=offs < n_ids, other=-1)
            inflight = index >= 0
            token = tl.load(Tokens + tl.where(inflight, index, 0), mask=inflight)
            tl.store(Packed + offs, token, mask=inflight)
    # Request table: req_to_token[rows[j], cols[j]] = values[j] (int32), rows, cols and values consecutive.
    for start in range(0, n_writes, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_writes
        row = tl.load(Packed + writes_start + offs, mask=mask, other=0)
        col = tl.load(Packed + writes_start + n_writes + offs, mask=mask, other=0)
        value = tl.load(Packed + writes_start + 2 * n_writes + offs, mask=mask, other=0)
        tl.store(Req_to_token + row * stride_r2t + col, value.to(tl.int32), mask=mask)


def apply_step_inputs(
    packed: torch.Tensor,
    tokens: torch.Tensor | None,
    index_start: int,
    n_ids: int,
    req_to_token: torch.Tensor,
    writes_start: int,
    n_writes: int,
) -> None:
    """In one launch, on the device: packed[i] = tokens[packed[index_start + i]] for the i < n_ids whose
    index is >= 0 (no tokens: skip), and req_to_token[r, c] = v for the n_writes entries laid out as rows
    packed[writes_start:][:n], then columns, then values. `packed` is the step's int64 device buffer,
    `tokens` the step in flight's int64 token ids, `req_to_token` the int32 [rows, max_len] table."""
    if packed.dtype != torch.int64 or packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError("packed: expected a contiguous int64 vector")
    if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token: expected an int32 table with contiguous rows")
    if tokens is None:
        tokens, index_start = packed, -1  # never read
    elif tokens.dtype != torch.int64 or not tokens.is_contiguous():
        raise ValueError("tokens: expected contiguous int64 token ids")
    if index_start < 0 and n_writes == 0:
        return
    _step_inputs_kernel[(1,)](
        packed, tokens, req_to_token, req_to_token.stride(0), n_ids, index_start, n_writes, writes_start,
        BLOCK=BLOCK, num_warps=4,
    )


def warm_step_kernels(device: torch.device, vocab_size: int) -> None:
    """Compile this module's kernel and greedy_argmax for `device` before the first request needs them (a
    model load calls this on CUDA), on throwaway buffers."""
    from kernels.sampling import greedy_argmax

    packed = torch.tensor([5, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.int64, device=device)
    table = torch.zeros((1, 2), dtype=torch.int32, device=device)
    apply_step_inputs(packed, torch.zeros(1, dtype=torch.int64, device=device), 5, 1, table, 6, 1)
    greedy_argmax(torch.zeros((1, vocab_size), dtype=torch.float32, device=device))
