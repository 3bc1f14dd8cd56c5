"""A decoder layer's batch-1 MLP block in one persistent launch: add-RMSNorm, gate_up, SiLU-and-mul, down.

Batch-1 decode of a small model is bound by kernel boundaries as much as by bytes (a Qwen3-0.6B step is
~170 launches; kernels/pdl.py). The MLP block is two of them, kernels/gemv.py's `rmsnorm_gemv` (gate_up)
and `silu_mul_gemv` (down), and at the boundary the down product's programs wait for the last gate_up
program before they read their first weight bytes. Here one launch of a fixed grid (a few programs an SM,
all resident) runs both products' row blocks as tasks taken from a queue:

- tasks 0 .. T1-1 are gate_up's row blocks, tasks T1 .. T1+T2-1 down's; a program takes the next task
  with an atomic on the queue counter, so tasks are taken in that order and every gate_up task is taken
  before any down task;
- a gate_up task stores its block of gate_up (task 0 also x + residual, as rmsnorm_gemv's program 0 does)
  and counts itself in on a done counter (a release after a barrier over the program's stores);
- a down task reads its first weight tile, then spins on the done counter (acquire) until all T1 gate_up
  tasks are in, then reads gate_up through L2 (`.cg`) and runs the product.

No task waits for one that has not been taken, and a taken task belongs to a running program, so the spin
always ends; with one program (Triton's interpreter runs programs one after another) the queue hands out
the tasks in order and nothing spins. The last program to leave puts the counters back to zero, for the
next launch and for CUDA-graph replays.

Each task's arithmetic is kernels/gemv.py's `_gemv_kernel` with the same tiles (the same jit prologues, the
same sums in the same order), so the block's outputs are `rmsnorm_gemv` then `silu_mul_gemv`, bit for bit.
Under PDL every program waits for the kernel before it first, and weights are the only reads before that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import GemvTiles, _weight_tile, check_prologue_row, prologue_input
from kernels.pdl import launch_options, pdl_enter

# Counters per device: [queue, gate_up tasks done, programs gone].
_counters: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class PersistentMlpTiles:
    """Row blocks of each product (the "rows" GEMV's tiles) and the grid: programs an SM."""

    gate_up: GemvTiles = GemvTiles(block_n=16, block_k=512)
    down: GemvTiles = GemvTiles(block_n=8, block_k=512)
    programs_per_sm: int = 4
    num_warps: int = 4


def counters(device: torch.device | str) -> torch.Tensor:
    """The zeroed counters of a device, made on first use (a warm-up call makes them before a graph
    capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _counters:
        _counters[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return _counters[device]


@triton.jit
def _gate_up_task(t, X, Residual, Norm_w, Res_out, W, Gu, N, K, stride_wn, eps, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  BLOCK_FULL: tl.constexpr):  # fmt: skip
    """_gemv_kernel's program t with the RMSNorm prologue (task 0 writes x + residual)."""
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    w_first = _weight_tile(W, safe_rows, stride_wn, tl.arange(0, BLOCK_K), K, EVEN_K)
    dtype = X.dtype.element_ty
    full = tl.arange(0, BLOCK_FULL)
    full_mask = full < K
    h = tl.load(X + full, mask=full_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + tl.load(Residual + full, mask=full_mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(Res_out + full, h, mask=full_mask & (t == 0))
        h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    x = prologue_input(X, Residual, Norm_w, tl.arange(0, BLOCK_K), K, rstd, 1, HAS_RESIDUAL, EVEN_K)
    acc += w_first.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(W, safe_rows, stride_wn, cols, K, EVEN_K)
        x = prologue_input(X, Residual, Norm_w, cols, K, rstd, 1, HAS_RESIDUAL, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(Gu + rows, y.to(Gu.dtype.element_ty), mask=row_mask)


@triton.jit
def _silu_input(Gu, cols, K, EVEN_K: tl.constexpr):
    """prologue_input's SiLU-and-mul (PROLOGUE 2) with gate_up read through L2: other programs of this
    launch wrote it, so no copy of it may come from this SM's L1."""
    dtype = Gu.dtype.element_ty
    mask = cols < K
    if EVEN_K:
        gate = tl.load(Gu + cols, cache_modifier=".cg").to(tl.float32)
        up = tl.load(Gu + K + cols, cache_modifier=".cg").to(tl.float32)
    else:
        gate = tl.load(Gu + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(Gu + K + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)


@triton.jit
def _down_task(t, Gu, W, Y, Done, gate_up_tasks, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):  # fmt: skip
    """_gemv_kernel's program t with the SiLU-and-mul prologue, once every gate_up task is in."""
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    w_first = _weight_tile(W, safe_rows, stride_wn, tl.arange(0, BLOCK_K), K, EVEN_K)
    done = tl.atomic_add(Done, 0, sem="acquire")
    while done < gate_up_tasks:
        done = tl.atomic_add(Done, 0, sem="acquire")
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    x = _silu_input(Gu, tl.arange(0, BLOCK_K), K, EVEN_K)
    acc += w_first.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = _weight_tile(W, safe_rows, stride_wn, cols, K, EVEN_K)
        x = _silu_input(Gu, cols, K, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_mask)


@triton.jit
def _persistent_mlp_kernel(
    X, Residual, Norm_w, Res_out, W_gu, Gu, W_d, Y, Counters,
    hidden, inter2, stride_gu, stride_d, eps, gate_up_tasks, down_tasks,
    BN1: tl.constexpr, BK1: tl.constexpr, EVEN1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    EVEN2: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_FULL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    total = gate_up_tasks + down_tasks
    t = tl.atomic_add(Counters, 1)
    while t < total:
        if t < gate_up_tasks:
            _gate_up_task(t, X, Residual, Norm_w, Res_out, W_gu, Gu, inter2, hidden, stride_gu, eps, BN1, BK1,
                          EVEN1, HAS_RESIDUAL, BLOCK_FULL)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_add(Counters + 1, 1, sem="release")
        else:
            _down_task(t - gate_up_tasks, Gu, W_d, Y, Counters + 1, gate_up_tasks, hidden, inter2 // 2, stride_d,
                       BN2, BK2, EVEN2)  # fmt: skip
        t = tl.atomic_add(Counters, 1)
    # The last program out puts the counters back (every task is done: each program left after its own).
    gone = tl.atomic_add(Counters + 2, 1, sem="acq_rel")
    if gone == tl.num_programs(0) - 1:
        tl.atomic_xchg(Counters, 0)
        tl.atomic_xchg(Counters + 1, 0)
        tl.atomic_xchg(Counters + 2, 0)


def persistent_mlp_grid(device: torch.device, tiles: PersistentMlpTiles, tasks: int) -> int:
    """Programs of a launch: tiles.programs_per_sm on each SM (one under the interpreter, on a CPU), at most
    one a task."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tasks, sms * tiles.programs_per_sm))


def persistent_mlp(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    tiles: PersistentMlpTiles = PersistentMlpTiles(),
    grid: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) with [gate | up] = gate_up(rmsnorm(x + residual)), x + residual) for one row
    x [1, H]: rmsnorm_gemv then silu_mul_gemv in one launch, the same bits with the same tiles. Without a
    residual the norm is of x alone and x is returned as the residual. `grid`: the programs (default
    persistent_mlp_grid's)."""
    h = x.shape[-1]
    inter2, hidden_in = gate_up_weight.shape
    if gate_up_weight.dim() != 2 or gate_up_weight.stride(1) != 1 or inter2 % 2:
        raise ValueError(f"gate_up_weight must be [2I, H] with contiguous rows, got {tuple(gate_up_weight.shape)}")
    if down_weight.dim() != 2 or down_weight.stride(1) != 1 or tuple(down_weight.shape) != (h, inter2 // 2):
        raise ValueError(f"down_weight must be [{h}, {inter2 // 2}] with contiguous rows, got "
                         f"{tuple(down_weight.shape)}")  # fmt: skip
    if hidden_in != h:
        raise ValueError(f"gate_up_weight takes {hidden_in} features but x has {h}")
    if x.dtype != gate_up_weight.dtype or x.dtype != down_weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weights are {gate_up_weight.dtype} and {down_weight.dtype}")
    check_prologue_row(x, h, tiles.gate_up, "persistent_mlp")
    check_prologue_row(x, h, tiles.down, "persistent_mlp")
    if norm_weight.shape != (h,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous of shape ({h},), got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    residual_out = torch.empty_like(x) if residual is not None else x
    gu = torch.empty((1, inter2), dtype=x.dtype, device=x.device)
    out = torch.empty((1, h), dtype=x.dtype, device=x.device)
    gate_up_tasks = triton.cdiv(inter2, tiles.gate_up.block_n)
    down_tasks = triton.cdiv(h, tiles.down.block_n)
    programs = grid or persistent_mlp_grid(x.device, tiles, gate_up_tasks + down_tasks)
    pdl = launch_options(x.device)
    _persistent_mlp_kernel[(programs,)](
        x, x if residual is None else residual, norm_weight, residual_out, gate_up_weight, gu, down_weight, out,
        counters(x.device), h, inter2, gate_up_weight.stride(0), down_weight.stride(0), eps, gate_up_tasks,
        down_tasks,
        BN1=tiles.gate_up.block_n, BK1=tiles.gate_up.block_k, EVEN1=h % tiles.gate_up.block_k == 0,
        BN2=tiles.down.block_n, BK2=tiles.down.block_k, EVEN2=(inter2 // 2) % tiles.down.block_k == 0,
        HAS_RESIDUAL=residual is not None, BLOCK_FULL=triton.next_power_of_2(h), PDL=bool(pdl), **pdl,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return out, residual_out
