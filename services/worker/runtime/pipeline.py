"""Pipeline parallelism: which layers a stage runs, and the activations it passes on.

A model of L decoder layers over pp_size stages: stage s runs the contiguous layers
stage_layers(L, s, pp_size) (the first L % pp_size stages one more than the others), the first stage
also the embedding, the last the final norm and the LM head (SGLang's start_layer / end_layer). A
stage's hidden states and residual stream go to the same TP rank of the next stage with
torch.distributed point-to-point (gloo on CPU, NCCL on CUDA), as one [2, tokens, hidden] tensor (SGLang's
PPProxyTensors), sent without waiting so a stage goes on with its next micro-batch. Every rank schedules
the same batch (the scheduler's commands are broadcast to all), so the receiver knows the tensor's
shape without being told.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from services.worker.runtime.distributed import get_pp_group, get_tp_rank

# The activations between two stages: (hidden states, residual stream), each [tokens, hidden].
ProxyTensors = tuple[torch.Tensor, torch.Tensor]


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers stage pp_rank of pp_size runs; ValueError when there are fewer layers than stages."""
    if num_layers < pp_size:
        raise ValueError(f"pp_size {pp_size} needs at least as many decoder layers; the model has {num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


class PPMissingLayer(nn.Module):
    """Stands in for a layer another stage runs: no parameters, so its weights are never loaded here,
    and the module names (model.layers.N) stay those of the checkpoint."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a layer of another pipeline stage was called on this one")


class PendingSends:
    """Activations on their way to the next stage (isend): a stage starts its next micro-batch without
    waiting for the next stage to take this one; `wait` before anything that must follow them."""

    def __init__(self) -> None:
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # the tensor lives until its send is done

    def send(self, proxy: ProxyTensors) -> None:
        """Hand this stage's output to the same TP rank of the next stage."""
        pp = get_pp_group()
        assert not pp.is_last, "the last stage samples; it sends no activations"
        tensor = torch.stack(proxy).contiguous()
        work = dist.isend(tensor, dst=pp.global_rank(pp.rank + 1, get_tp_rank()))
        assert work is not None
        self._sends.append((work, tensor))

    def wait(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def recv_from_prev_stage(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> ProxyTensors:
    """The previous stage's output for a step of num_tokens tokens."""
    pp = get_pp_group()
    assert not pp.is_first, "the first stage embeds its tokens; it receives no activations"
    buffer = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    dist.recv(buffer, src=pp.global_rank(pp.rank - 1, get_tp_rank()))
    return buffer[0], buffer[1]
