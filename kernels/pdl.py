"""Programmatic dependent launch (PDL): the next decode kernel starts while the one before it finishes.

A batch-1 decode step is ~170 (0.6B) to ~250 (8B) kernels in a row, each too small to fill the GPU for
long: every boundary costs the next grid's launch and ramp-up, and its first weight bytes arrive a DRAM
latency later. On Hopper a kernel launched with the programmatic-stream-serialization attribute
(`launch_pdl=True` in Triton) may be scheduled as soon as every program of the kernel before it has
executed `griddepcontrol.launch_dependents`; it must execute `griddepcontrol.wait` before it reads
anything the earlier kernels wrote, and the wait returns once those kernels have completed and their
writes are visible. CUDA graphs keep the dependency (a programmatic edge), so replays overlap the same way.

The protocol every kernel here follows when PDL is on (`pdl_enter`):
- before the wait, a program only reads what no kernel of the forward writes (weights), never writes;
- every program waits, unconditionally, before anything else: a kernel that completes has then seen its
  predecessor complete, so the guarantee is transitive down the chain;
- a program releases its dependents right after its wait, never before: the next kernel is resident at
  most one kernel early, so its pre-wait reads overlap the kernel just before it and nothing older is
  still running when they happen.
What the overlap buys is spent in `prefetch_l2`: while it waits, a GEMV asks the L2 for the first bytes of
its weight rows, so its loop starts on L2 hits instead of DRAM misses.

Off (the default elsewhere): under the interpreter, on CPUs and GPUs before sm90, and with RS_PDL=0
(for A/B runs; RS_PDL_PREFETCH=0 keeps PDL without the prefetch). `launch_options` gives the launch's keyword, `PDL` the kernels' constexpr.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.interpreter_compat import interpreting

PDL_ENV = "RS_PDL"
PREFETCH_ENV = "RS_PDL_PREFETCH"


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched for `device` use PDL: CUDA sm90+, not interpreted, RS_PDL not '0'."""
    if device.type != "cuda" or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that calls pdl_enter(PDL): launch_pdl where PDL is on
    (the interpreter rejects the keyword, so it is left out there)."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the next one be scheduled (the module docstring's
    protocol). Every program of a PDL kernel calls this before it reads an activation."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(row_ptrs, nbytes, PREFETCH: tl.constexpr):
    """Start copying `nbytes` (> 0, a multiple of 16, from 16-byte aligned addresses: prefetch_bytes) at
    each of `row_ptrs` into the L2 (sm90's bulk prefetch: no registers, nothing waits on it). A hint
    only; PREFETCH False (no PDL, or prefetch_bytes 0) leaves it out."""
    if PREFETCH:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [row_ptrs, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def prefetch_bytes(weight: torch.Tensor, columns: int) -> int:
    """Bytes of each weight row prefetch_l2 may ask for: the first `columns` of them (at most the row),
    or 0 where the bulk prefetch's 16-byte alignment does not hold for every row."""
    if os.environ.get(PREFETCH_ENV, "1") == "0":
        return 0
    size = weight.element_size()
    nbytes = min(columns, weight.shape[-1]) * size
    aligned = weight.data_ptr() % 16 == 0 and (weight.stride(-2) * size) % 16 == 0 and nbytes % 16 == 0
    return nbytes if aligned else 0
