"""Gated DeltaNet: the linear-attention layer of Qwen3.5 (and Qwen3-Next).

Per token: one fused projection gives the conv input (q, k, v), the output gate z and the per-head
write strength b and decay a; q, k, v go through a causal depthwise conv1d (kernel W, SiLU) that
continues from the request's last W-1 inputs; then the gated delta rule updates a [Hv, Dk, Dv] state
per head (decay exp(g), g = -exp(A_log) * softplus(a + dt_bias); write strength sigmoid(b); q and k
l2-normalised) and reads it with q; a gated RMSNorm (norm(o) * silu(z)) and out_proj finish.

Both states live in the StatePool (mem/state_pool.py), one row per request, found through
batch.state_metadata. Extend steps (prefill chunks, mixed decodes) use the chunked rule, decode steps
the one-token update; the ops are gdn_ops.py's (the Triton kernels implement the same signatures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.runtime.distributed import get_tp_size
from services.worker.runtime.layers.gdn_ops import (
    causal_conv1d_fwd,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
)
from services.worker.runtime.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_weight_shape,
    default_weight_loader,
    full_weight,
    new_parameter,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from services.worker.runtime.forward_batch import ForwardBatch


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * silu(gate) per head (transformers' Qwen3_5RMSNormGated, rounding included:
    the norm in float32, the scale in the input dtype, the gate in float32)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((head_dim,), default_weight_loader)
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def _load_conv_weight(param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
    """The checkpoint's nn.Conv1d weight [C, 1, W] (or [C, W]) into the [C, W] parameter."""
    weight = full_weight(loaded_weight)
    if weight.dim() == 3:
        check_weight_shape(weight, (param.shape[0], 1, param.shape[1]), "linear_attn.conv1d")
        weight = weight[:, 0]
    check_weight_shape(weight, tuple(param.shape), "linear_attn.conv1d")
    param.data.copy_(weight)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `state_id` is its index among the model's linear layers (its
    StatePool tensors)."""

    def __init__(self, hf: PretrainedConfig, hidden_size: int, state_id: int) -> None:
        super().__init__()
        if get_tp_size() != 1:
            raise ValueError("Gated DeltaNet layers do not support tensor parallelism (tp_size must be 1)")
        self.state_id = state_id
        self.num_k_heads = int(hf.linear_num_key_heads)
        self.num_v_heads = int(hf.linear_num_value_heads)
        self.head_k_dim = int(hf.linear_key_head_dim)
        self.head_v_dim = int(hf.linear_value_head_dim)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = int(hf.linear_conv_kernel_dim)
        self.activation = str(hf.hidden_act)
        self.scale = self.head_k_dim**-0.5
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one product (shard ids 0..3).
        self.in_proj = MergedColumnParallelLinear(
            hidden_size, [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        )
        self.conv_weight = new_parameter((self.conv_dim, self.conv_width), _load_conv_weight)
        self.dt_bias = new_parameter((self.num_v_heads,), default_weight_loader)
        self.A_log = new_parameter((self.num_v_heads,), default_weight_loader)
        self.norm = GatedRMSNorm(self.head_v_dim, float(hf.rms_norm_eps))
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.state_metadata
        if meta is None:
            raise ValueError("a linear-attention layer needs batch.state_metadata (HybridReqToTokenPool)")
        conv_state, recurrent_state = meta.state_pool.layer(self.state_id)
        mixed, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        decode = batch.forward_mode.is_decode()
        if decode:
            mixed = causal_conv1d_update(
                mixed, self.conv_weight, None, conv_state=conv_state, state_indices=meta.state_indices,
                activation=self.activation,
            )
        else:
            mixed = causal_conv1d_fwd(
                mixed, self.conv_weight, None, conv_state=conv_state, state_indices=meta.state_indices,
                cu_seqlens=meta.cu_seqlens, has_initial_state=meta.has_initial_state, activation=self.activation,
            )
        tokens = hidden.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if decode:
            core = fused_recurrent_gated_delta_rule_update(
                q, k, v, g, beta, state=recurrent_state, state_indices=meta.state_indices, scale=self.scale
            )
        else:
            core = chunk_gated_delta_rule(
                q, k, v, g, beta, state=recurrent_state, state_indices=meta.state_indices,
                cu_seqlens=meta.cu_seqlens, scale=self.scale,
            )
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(tokens, self.value_dim))
