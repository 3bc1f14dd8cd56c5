"""Programmatic dependent launch (PDL): the next decode kernel starts while the one before it finishes.

A batch-1 decode step is ~170 (0.6B) to ~250 (8B) kernels in a row, each too small to fill the GPU for
long: every boundary costs the next grid's launch and ramp-up, and its first weight bytes arrive a DRAM
latency later. On Hopper a kernel launched with the programmatic-stream-serialization attribute
(`launch_pdl=True` in Triton) may be scheduled as soon as every program of the kernel before it has
executed `griddepcontrol.launch_dependents`; it must execute `griddepcontrol.wait` before it reads
anything the earlier kernels wrote, and the wait returns once those kernels have completed and their
writes are visible. CUDA graphs keep the dependency (a programmatic edge), so replays overlap the same way.

The protocol every kernel here follows when PDL is on (`pdl_enter`):
- before the wait, a program writes nothing and reads nothing but weights (kernels/gemv.py's preload);
- every program waits, unconditionally, before anything else: a kernel that completes has then seen its
  predecessor complete, so the guarantee is transitive down the chain;
- a program releases its dependents right after its wait, never before: the next kernel becomes
  resident at most one kernel early (two kernels of the chain at a time), and what it saves is its
  launch and ramp-up, hidden behind the kernel before it. RS_PDL_EARLY_RELEASE=1 (pdl_mode 2, for A/B
  runs) releases before the wait instead, so kernels further ahead may start reading their weights (with
  kernels/gemv.py's RS_PDL_PRELOAD_SLICE, up to three tiles each); every wait is still for a completed
  kernel, so what is read after it does not change.
What it buys (H200, CUDA graphs, bench/gpu_pdl.py, 2026-12-04): batch-1 decode 1.10x on Qwen3-0.6B
(1,057 -> 1,164 tok/s) and 1.02x on Qwen3-8B, greedy tokens and log-probs identical bit for bit. Spending
the early start on an L2 bulk prefetch of each GEMV's first weight columns (cp.async.bulk.prefetch) was
tried and dropped: no gain at 0.6B and 0.87x at 8B. Loading them into registers instead (kernels/gemv.py's
PRELOAD, RS_PDL_PRELOAD) gave 1.07-1.10x at 0.6B and 0.96x at 8B, so only products up to 16 MiB do it.
Asking the L2 for the *next* product's weight instead (each program its share, before its wait) shortened a
chain of 112 0.6B-shaped GEMVs to 0.91x its time but made the Engine's 0.6B step 0.90x as fast (H100,
2026-12-06): dropped too.
Decode attention with its prologue reading the step's inputs and its first tile of earlier keys and values
before its wait (only earlier steps wrote those; the new token's row put into the tile in registers) gave
the same bits and nothing else: 0.6B batch-1 decode 0.999x with 8 warps a program, 0.964x with 4, whose
registers then spilled (H100, 2026-12-06). Dropped.
Weights are the one thing read before the wait: they are constant during a step. The FP8 tensor-core GEMV
(kernels/fp8_gemv_mma.read_ahead) reads ahead too, and where it waits inside its loop (pdl_gate) every
activation pointer carries the wait's value, so the compiler cannot move a read of one above it.

Off (the default elsewhere): under the interpreter, on CPUs and GPUs before sm90, and with RS_PDL=0
(for A/B runs). `launch_options` gives the launch's keyword, `PDL` the kernels' constexpr.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.interpreter_compat import interpreting

PDL_ENV = "RS_PDL"
PRELOAD_ENV = "RS_PDL_PRELOAD"
EARLY_RELEASE_ENV = "RS_PDL_EARLY_RELEASE"


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched for `device` use PDL: CUDA sm90+, not interpreted, RS_PDL not '0'."""
    if device.type != "cuda" or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def preload_weights() -> bool:
    """Whether a PDL kernel reads its first weight tile before its wait (RS_PDL_PRELOAD, default on):
    weights are constant during a step, so those loads may overlap the kernel before."""
    return os.environ.get(PRELOAD_ENV, "1") != "0"


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that calls pdl_enter(PDL): launch_pdl where PDL is on
    (the interpreter rejects the keyword, so it is left out there)."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}


def pdl_mode(options: dict[str, bool]) -> int:
    """The kernels' PDL constexpr for a launch with `options` (launch_options'): 0 off; 1 on, each program
    releasing its dependents right after its wait; 2 on, releasing them before it (RS_PDL_EARLY_RELEASE=1):
    the next kernel may then be scheduled as soon as every program of this one has started, and the one
    after it as soon as that one's have, so several kernels ahead can be reading their weights. The wait
    still waits for the whole kernel before to complete, so what a program reads after it is the same."""
    if not options:
        return 0
    return 2 if os.environ.get(EARLY_RELEASE_ENV, "0") == "1" else 1


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one and let the next one be scheduled, after the wait (PDL 1) or
    before it (2; pdl_mode). Every program of a PDL kernel calls this before it reads an activation."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_gate(PDL: tl.constexpr):
    """The wait of pdl_enter as a value: 0, produced by the wait itself, for a kernel that reads weights
    in a loop's pipelined copies before it. Adding it to every activation pointer ties those reads to the
    wait: with a plain wait in the loop's first turn, the compiler moved that turn's read of the row above
    it (seen in the PTX). Called every turn (a wait whose grid has completed returns at once); the release
    is pdl_release's."""
    if PDL == 2:
        gate = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;",
                                         "=r", [], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    elif PDL:
        gate = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)  # fmt: skip
    else:
        gate = 0
    return gate


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be scheduled (after a pdl_gate; PDL 2's gate has done it before its wait)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
