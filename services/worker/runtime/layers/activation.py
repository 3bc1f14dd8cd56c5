"""Gated activations: the fused gate_up projection's output [.., 2 * I] -> act(gate) * up [.., I].

On CUDA a 2-D input takes one Triton launch (kernels/activation.py) instead of three torch ops, on the CPU
in float32 or bfloat16 one C++ op (kernels/cpu/rows.cpp, its exp within 2 ulp of torch's; bfloat16 rounded
where torch rounds). With
deterministic inference (`batch_invariant`) the CPU computes the SiLU through batch_invariant.elementwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_matvec import ROW_DTYPES, row_ops
from services.worker.runtime.layers import batch_invariant


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        # Imported here: triton is needed (and installed) only where CUDA runs.
        from kernels.activation import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(x)
    if x.dtype in ROW_DTYPES and x.dim() == 2 and x.stride(-1) == 1 and x.device.type == "cpu":
        if (ops := row_ops()) is not None:
            return ops.silu_mul_rows(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's activation on a fused [gate | up] tensor."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and not x.is_cuda:
            return batch_invariant.silu_and_mul(x)
        return silu_and_mul(x)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
    return SiluAndMul()
