"""The process groups of one worker: its tensor-parallel group, and the pipeline stages around it.

A worker runs pp_size * tp_size ranks: global rank = pp_rank * tp_size + tp_rank (SGLang's layout), so a
stage's TP ranks are consecutive (with --nnodes, on the same node when tp_size divides the ranks per
node). Each stage has a TP group of its own for the layers' collectives; stages pass activations
point to point (runtime/pipeline.py); control broadcasts (new requests, sampled tokens) go to every rank.
With one rank nothing is initialised and the collectives are identities, so single-device code pays
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


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage: `rank` of `size` stages, each of `tp_size` consecutive global ranks."""

    rank: int = 0
    size: int = 1
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank


_GROUP = TPGroup()
_PP = PPGroup()
# This stage's TP ranks as a torch process group; None: the default (world) group, which they are
# whenever pp_size is 1.
_TP_PROCESS_GROUP: dist.ProcessGroup | None = None


def init_tp(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float | None = None,
    pp_size: int = 1,
) -> None:
    """Join the worker's process group (one process per rank, on one node or several): `size` TP ranks
    in each of `pp_size` stages; `rank` is the global rank (pp_rank * size + tp_rank). init_method: e.g.
    'tcp://10.0.0.1:29500', where global rank 0 listens; timeout_s: how long the rendezvous waits for
    every rank, and a collective for the other ranks (None: torch's default). A group that does not
    form in time is a RuntimeError saying what to check, never a hang."""
    global _GROUP, _PP, _TP_PROCESS_GROUP
    world = size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the {world} ranks of tp_size {size} x pp_size {pp_size}")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            try:
                dist.init_process_group(
                    backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
                )
            except (dist.DistError, RuntimeError) as exc:  # DistStoreError (a rendezvous timeout) is a DistError
                waited = "torch's default timeout" if timeout_s is None else f"{timeout_s:g} s (dist_timeout)"
                raise RuntimeError(
                    f"rank {rank} of {world} (tp_size {size} x pp_size {pp_size}): the group did not form at "
                    f"{init_method} within {waited}: {exc}. Every node must be started, with the same "
                    "dist_init_addr (node 0's address), nnodes, tp_size and pp_size, and node 0's port must be "
                    "reachable from every node"
                ) from None
        if pp_size > 1 and size > 1:
            # Every rank creates every stage's group, in the same order (torch requires it).
            for stage in range(pp_size):
                group = dist.new_group(list(range(stage * size, (stage + 1) * size)), timeout=timeout)
                if stage == rank // size:
                    _TP_PROCESS_GROUP = group
        logger.info("rank %d of %d (stage %d of %d, TP rank %d of %d) joined the group at %s (%s)",
                    rank, world, rank // size, pp_size, rank % size, size, init_method, backend)
    _GROUP = TPGroup(rank=rank % size, size=size)
    _PP = PPGroup(rank=rank // size, size=pp_size, tp_size=size)


def check_same_everywhere(fingerprint: str, where: str) -> None:
    """Collective: ValueError on every rank when some rank's `fingerprint` (what it runs: model config,
    group shape) differs from rank 0's, naming both ranks' `where` (node, host, model path) and both
    fingerprints. Nodes started with different models or flags fail here, before any weight loads."""
    if get_world_size() == 1:
        return
    every: list[object] = [None] * get_world_size()
    dist.all_gather_object(every, (fingerprint, where))
    first_print, first_where = every[0]  # type: ignore[misc]
    for rank, (other_print, other_where) in enumerate(every):  # type: ignore[misc]
        if other_print != first_print:
            raise ValueError(
                f"the TP group's ranks run different things: rank 0 ({first_where}) runs {first_print}; rank "
                f"{rank} ({other_where}) runs {other_print}. Start every node with the same model and the "
                "same tp_size, pp_size, nnodes and dtype"
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
    if _GROUP.size == 1 or device.type != "cuda" or _PP.size > 1:  # its buffers rendezvous over the world
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
    global _GROUP, _FAST, _PP, _TP_PROCESS_GROUP
    _FAST = None
    _TP_PROCESS_GROUP = None
    if dist.is_initialized():
        if exiting and dist.get_backend() == "nccl":
            torch.cuda.synchronize()
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _GROUP = TPGroup()
    _PP = PPGroup()


def get_tp_rank() -> int:
    return _GROUP.rank


def get_tp_size() -> int:
    return _GROUP.size


def get_pp_group() -> PPGroup:
    return _PP


def get_world_size() -> int:
    return _GROUP.size * _PP.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks: in place through NCCL, or a new tensor through FastAllReduce; use the result."""
    if _GROUP.size == 1:
        return x
    if _FAST is not None:
        summed = _FAST(x)
        if summed is not None:
            return summed
    dist.all_reduce(x, group=_TP_PROCESS_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim (rank order)."""
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_PROCESS_GROUP)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from global rank src to every rank of every stage (control path only:
    new requests, aborts, the last stage's sampled tokens)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
