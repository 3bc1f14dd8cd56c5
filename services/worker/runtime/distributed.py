"""The tensor-parallel group of one worker: rank, size and the two collectives layers need.

With tp_size 1 nothing is initialised and the collectives are identities, so single-device code pays
nothing. CPU runs use gloo (tests spawn two processes); CUDA runs use NCCL, and on CUDA the small
all-reduces of decode steps can go through PyTorch's symmetric memory instead (enable_fast_all_reduce).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_GROUP = TPGroup()


def init_tp(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float | None = None
) -> None:
    """Join the TP process group (one process per rank, on one node or several). init_method: e.g.
    'tcp://10.0.0.1:29500', where global rank 0 listens; timeout_s: how long the rendezvous waits for
    every rank, and a collective for the other ranks (None: torch's default). A group that does not
    form in time is a RuntimeError saying what to check, never a hang."""
    global _GROUP
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            try:
                dist.init_process_group(
                    backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
                )
            except (dist.DistError, RuntimeError) as exc:  # DistStoreError (a rendezvous timeout) is a DistError
                waited = "torch's default timeout" if timeout_s is None else f"{timeout_s:g} s (dist_timeout)"
                raise RuntimeError(
                    f"TP rank {rank} of {size}: the group did not form at {init_method} within {waited}: {exc}. "
                    "Every node must be started, with the same dist_init_addr (node 0's address), nnodes and "
                    "tp_size, and node 0's port must be reachable from every node"
                ) from None
        logger.info("TP rank %d of %d joined the group at %s (%s)", rank, size, init_method, backend)
    _GROUP = TPGroup(rank=rank, size=size)


def check_same_everywhere(fingerprint: str, where: str) -> None:
    """Collective: ValueError on every rank when some rank's `fingerprint` (what it runs: model config,
    group shape) differs from rank 0's, naming both ranks' `where` (node, host, model path) and both
    fingerprints. Nodes started with different models or flags fail here, before any weight loads."""
    if _GROUP.size == 1:
        return
    every: list[object] = [None] * _GROUP.size
    dist.all_gather_object(every, (fingerprint, where))
    first_print, first_where = every[0]  # type: ignore[misc]
    for rank, (other_print, other_where) in enumerate(every):  # type: ignore[misc]
        if other_print != first_print:
            raise ValueError(
                f"the TP group's ranks run different things: rank 0 ({first_where}) runs {first_print}; rank "
                f"{rank} ({other_where}) runs {other_print}. Start every node with the same model and the "
                "same tp_size, nnodes and dtype"
            )


class FastAllReduce:
    """One-shot all-reduce over symmetric memory: each rank copies its tensor into its own registered
    buffer, a barrier, then every rank reads all ranks' buffers over NVLink and sums them in rank order
    (so every rank holds the same bits). One launch and no NCCL protocol: 9.5 us against NCCL's 33 us
    for a [1, 4096] bf16 sum on two H200s (bench/gpu_tp.py), which decode steps do twice a layer.

    Two buffers alternate. A rank leaves call N's barrier only when every rank has reached it, so when
    it writes call N+2's input into call N's buffer every rank has finished reading that buffer (they
    have reached call N+1). A tensor over `max_bytes` (prefill steps) goes to NCCL, which is faster for
    large sums. NVLink multicast is not used."""

    def __init__(self, dtype: torch.dtype, device: torch.device, max_bytes: int) -> None:
        # Imported here: a private torch module that only CUDA builds with symmetric memory carry.
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        self.buffer = symm_mem.empty((2, self.max_numel), dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum over ranks as a new tensor, or None when x is not for this path."""
        if x.dtype != self.dtype or x.numel() > self.max_numel or not x.is_contiguous():
            return None
        buffer = self.buffer[self.calls % 2, : x.numel()].view(x.shape)
        self.calls += 1
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, x, "sum", self.group_name)


_FAST: FastAllReduce | None = None


def enable_fast_all_reduce(dtype: torch.dtype, device: torch.device, max_bytes: int = 1 << 20) -> bool:
    """Route all-reduces of up to max_bytes through FastAllReduce. Collective: every rank calls it at
    the same point, before any CUDA graph capture. False (NCCL stays) where it cannot run here."""
    global _FAST
    if _GROUP.size == 1 or device.type != "cuda":
        return False
    try:
        _FAST = FastAllReduce(dtype, device, max_bytes)
    except Exception as exc:  # noqa: BLE001 - an older torch or a driver without P2P: NCCL still works
        logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(exc).__name__, exc)
        _FAST = None
        return False
    return True


def destroy_tp(exiting: bool = False) -> None:
    """Leave the group. `exiting`: this process ends next (a rank process), so an NCCL group is
    aborted once the device is idle rather than shut down gracefully: on the H200s the graceful NCCL
    shutdown of both ranks hung until the parent killed them 30 s later (bench/gpu_tp.py, float32
    engines), and an exiting process has nothing left for it to wait for."""
    global _GROUP, _FAST
    _FAST = None
    if dist.is_initialized():
        if exiting and dist.get_backend() == "nccl":
            torch.cuda.synchronize()
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _GROUP = TPGroup()


def get_tp_rank() -> int:
    return _GROUP.rank


def get_tp_size() -> int:
    return _GROUP.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks: in place through NCCL, or a new tensor through FastAllReduce; use the result."""
    if _GROUP.size == 1:
        return x
    if _FAST is not None:
        summed = _FAST(x)
        if summed is not None:
            return summed
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim (rank order)."""
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tp_broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from src to every rank (control path only: new requests, aborts)."""
    if _GROUP.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
