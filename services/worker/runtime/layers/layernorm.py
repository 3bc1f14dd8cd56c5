"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

On CUDA each is one Triton launch (kernels/rmsnorm.py: the add, the statistics and the scaling in one
pass); elsewhere a few torch ops with the same rounding.
"""

from __future__ import annotations

import torch
from torch import nn

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
        # (torch.rms_norm is bit-identical in float32 but measured slower here at batch 16.)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


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
