"""Rotary position embedding, neox style (the two halves of each head are the rotated pairs).

cos/sin are precomputed once per model for every position up to the context length, in float32 and
exactly as HF computes them, and shared by all layers. On CUDA one Triton launch (kernels/qk_norm_rope.py
with its norm and pool store off) rotates q and k in place, in float32; on the CPU in float32 or bfloat16
one C++ op (kernels/cpu/rows.cpp, `norm_rope_in_place`) does the same with the heads' norms, rounding as
the torch ops do; elsewhere torch ops
return rotated copies, with the per-position tables gathered once per forward rather than once per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.cpu_matvec import ROW_DTYPES, row_ops
from services.worker.runtime.layers.layernorm import RMSNorm

# Rope types whose frequencies are fixed at load time (dynamic NTK rescales per sequence length).
STATIC_SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The rope settings as one dict with 'rope_theta' and 'rope_type', whether the config uses
    transformers-5 `rope_parameters` or the classic `rope_theta` + `rope_scaling` fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of every head of q and k by position."""

    def __init__(
        self,
        head_dim: int,
        inv_freq: torch.Tensor,
        max_position: int,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        self.register_buffer("cos_cache", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_scaling, persistent=False)
        # CPU path: (positions, dtype, cos table, signed sin table) of the last forward.
        self._tables: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        return out.flatten(1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads * head_dim], k: [num_tokens, kv_heads * head_dim]. On CUDA q and k are
        rotated in place (views into a fused qkv output are fine: the rows may be strided)."""
        if q.is_cuda:
            # Imported here: triton is needed (and installed) only where CUDA runs.
            from kernels.qk_norm_rope import qk_norm_rope_

            return qk_norm_rope_(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim)
        if self.rotary_dim == self.head_dim:
            cos, sin = self._full_width(positions, q.dtype)
            return self._rotate_full(q, cos, sin), self._rotate_full(k, cos, sin)
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def norm_rope_in_place(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None
    ) -> bool:
        """On the CPU in float32 or bfloat16 with kernels/cpu/rows.cpp loaded: each head of q and k
        RMS-normalized by q_norm / k_norm (None skips it) and rotated, in place, in one op (the same bits as
        the torch ops' rotation; the norms sum their squares in double), and True. Else nothing and False."""
        ops = row_ops()
        if ops is None or q.dtype not in ROW_DTYPES or q.device.type != "cpu" or q.dim() != 2 or k.dim() != 2:
            return False
        if k.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dtype != torch.int64:
            return False
        if self.cos_cache.dtype != torch.float32:
            return False
        norms = (q_norm, k_norm)
        if any(n is not None and (type(n) is not RMSNorm or n.weight.dtype != q.dtype) for n in norms):
            return False
        epses = {n.eps for n in norms if isinstance(n, RMSNorm)}
        if len(epses) > 1:
            return False
        weights = [n.weight if isinstance(n, RMSNorm) else None for n in norms]
        eps = epses.pop() if epses else 0.0
        ops.qk_norm_rope_rows_(q, k, positions, self.cos_cache, self.sin_cache, *weights, eps, self.head_dim)
        return True

    def _full_width(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, head_dim] (cos, cos) and (-sin, sin) for these positions, built once per forward:
        every layer gets the same `positions` tensor, so the last one's tables are reused."""
        cached = self._tables
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        cos2 = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype)
        sin2 = torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype)
        self._tables = (positions, dtype, cos2, sin2)
        return cos2, sin2

    def _rotate_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + swap_halves(x) * (-sin, sin): HF's q * cos + rotate_half(q) * sin, rounding for
        rounding (x2 * -sin is exactly -(x2 * sin)), in four tensor ops."""
        x = x.reshape(x.shape[0], -1, self.head_dim)
        return (x * cos + x.roll(self.rotary_dim // 2, dims=-1) * sin).flatten(1)


def get_rope(hf_config: PretrainedConfig, head_dim: int, max_position: int) -> RotaryEmbedding:
    """The model's rotary embedding: default rope with the checkpoint's theta, or a statically scaled
    variant (linear, yarn, llama3) whose frequencies transformers computes for us."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
        scaling = 1.0
    elif rope_type in STATIC_SCALED_ROPE_TYPES:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    else:
        raise ValueError(
            f"rope type {rope_type!r} (config rope_parameters/rope_scaling) is not supported; "
            f"supported: default, {', '.join(STATIC_SCALED_ROPE_TYPES)}"
        )
    return RotaryEmbedding(head_dim, inv_freq, max_position, float(scaling))
