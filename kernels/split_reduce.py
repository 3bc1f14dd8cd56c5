"""Split-K with a reduction in a fixed order, in the same launch (kernels/fp8_gemv_mma.py, and
kernels/batch_invariant.py's products for --enable-deterministic-inference).

A product whose output tiles are too few to fill the GPU splits K across programs too. Each program of
an output tile writes its float32 partial sums to a workspace slab of its own and takes a ticket from
the tile's counter; the program that takes the last ticket adds the slabs in split order (so the result
does not depend on which program finishes first: the same bits every run) and writes the output, then
puts the counter back to zero, so the same counters serve the next launch and CUDA-graph replays."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Ticket counters per device: one per output tile of a launch.
TICKETS = 65536
_tickets: dict[torch.device, torch.Tensor] = {}


def ticket_counters(device: torch.device | str) -> torch.Tensor:
    """The zeroed ticket counters of a device (made once, on first use; a launch inside CUDA-graph capture
    needs them made before, which a warm-up call does)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _tickets:
        _tickets[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return _tickets[device]


def split_workspace(splits: int, elements: int, like: torch.Tensor) -> torch.Tensor:
    """The float32 slabs of a split launch ([splits, elements]); a placeholder when there is no split."""
    if splits == 1:
        return like
    return torch.empty((splits, elements), dtype=torch.float32, device=like.device)


@triton.jit
def store_split(acc, Y, out_offs, Work, part_offs, slab, Tickets, tile, pid_k, mask, SPLIT: tl.constexpr):
    """Store this program's float32 `acc` at Y + out_offs (in Y's dtype), or, when K is split, its part at
    Work + pid_k * slab + part_offs, and where it is the tile's last part, the parts' sum in split order."""
    if SPLIT == 1:
        tl.store(Y + out_offs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(Work + pid_k * slab + part_offs, acc, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(Tickets + tile, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):
                total += tl.load(Work + s * slab + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Y + out_offs, total.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Tickets + tile, 0)


def check_tiles(tiles: int) -> None:
    """A split launch has one counter per output tile."""
    if tiles > TICKETS:
        raise ValueError(f"a split launch takes at most {TICKETS} output tiles, got {tiles}")
