"""The tensor-parallel group of one worker: rank, size and the two collectives layers need.

With tp_size 1 nothing is initialised and the collectives are identities, so single-device code pays
nothing. CPU runs use gloo (tests spawn two processes); CUDA runs use NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_GROUP = TPGroup()


def init_tp(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the TP process group (one process per rank). init_method: e.g. 'tcp://127.0.0.1:29500'."""
    global _GROUP
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    _GROUP = TPGroup(rank=rank, size=size)


def destroy_tp() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TPGroup()


def get_tp_rank() -> int:
    return _GROUP.rank


def get_tp_size() -> int:
    return _GROUP.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place when possible."""
    if _GROUP.size == 1:
        return x
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
