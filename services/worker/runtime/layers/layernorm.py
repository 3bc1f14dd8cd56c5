"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

On CUDA each is one Triton launch (kernels/rmsnorm.py: the add, the statistics and the scaling in one
pass); on the CPU in float32 or bfloat16, one C++ op (kernels/cpu/rows.cpp: the squares summed in double,
as the batch-1 product's prologue does; in bfloat16 rounded where the torch ops round); elsewhere a few
torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels.cpu_matvec import ROW_DTYPES, row_ops
from services.worker.runtime.layers.linear import default_weight_loader, new_parameter


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as HF does, so logits match).

    With `residual`, returns (norm(x + residual), x + residual): the sum becomes the next residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), default_weight_loader)
        nn.init.ones_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            # Imported here: triton is needed (and installed) only where CUDA runs.
            from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if (ops := _cpu_rows(x, self.weight)) is not None:
            if residual is None:
                return ops.rmsnorm_rows(x, self.weight, self.eps)
            if residual.stride(-1) == 1 and residual.dim() == 2:
                return ops.add_rmsnorm_rows(x, residual, self.weight, self.eps)
        # (torch.rms_norm is bit-identical in float32 but measured slower here at batch 16.)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _cpu_rows(x: torch.Tensor, weight: torch.Tensor) -> Any:
    """kernels/cpu/rows.cpp's ops where they take x: float32 or bfloat16 CPU rows [M, K] with contiguous
    rows and a weight of x's dtype, the library loaded (one op for the norm's ~7 torch calls); else None."""
    ops = row_ops()
    if ops is None or x.dtype not in ROW_DTYPES or weight.dtype != x.dtype or x.dim() != 2:
        return None
    return ops if x.stride(-1) == 1 and x.device.type == "cpu" else None


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32 and cast back at the end (Qwen3.5, Gemma): the
    checkpoint stores the scale's offset from 1. Same `residual` contract as RMSNorm. On CUDA the
    Triton kernel's zero-centered form: the torch form is ~11 launches per norm, which made ~700 of a
    Qwen3.5-9B batch-1 decode step's ~850 kernels (1.2 of its 5.7 ms on the H200)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), default_weight_loader)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps, zero_centered=True)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps, zero_centered=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
