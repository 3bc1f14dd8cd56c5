"""Gated DeltaNet: the linear-attention layer of Qwen3.5 (and Qwen3-Next).

Per token: one fused projection gives the conv input (q, k, v), the output gate z and the per-head
write strength b and decay a; q, k, v go through a causal depthwise conv1d (kernel W, SiLU) that
continues from the request's last W-1 inputs; then the gated delta rule updates a [Hv, Dk, Dv] state
per head (decay exp(g), g = -exp(A_log) * softplus(a + dt_bias); write strength sigmoid(b); q and k
l2-normalised) and reads it with q; a gated RMSNorm (norm(o) * silu(z)) and out_proj finish.

Tensor parallel: each rank keeps Hk / tp q/k heads and the Hv / tp v heads they serve (in_proj, the
conv channels, A_log and dt_bias split alike; out_proj row-parallel, one all-reduce), so its states hold
only its heads.

Both states live in the StatePool (mem/state_pool.py), one row per request, found through
batch.state_metadata. Extend steps (prefill chunks, mixed decodes) use the chunked rule, decode steps
the one-token update; an extend that tracks (mem/state_pool.py's StateTrack, made by mem/state_snapshots.py) stops the chunked
rule one token short for the tracked sequences, saves their state, and ends them with the update. The ops follow the step's attention backend: the torch backend (CPU, and the
reference on CUDA) runs gdn_ops.py's torch ops; the GPU backends (triton, flashinfer) run the Triton
kernels of the same signatures (kernels/causal_conv1d.py, kernels/gated_delta_rule.py,
kernels/gated_rms_norm.py), which never sync with the host, so a CUDA graph captures a decode step
(cuda_graph_runner.py: padded rows use state row 0, the padding row). A decode step hands the raw a and
b to fused_sigmoid_gating_delta_rule_update, whose Triton kernel forms g and beta itself: with the
one-pass gated norm that spares each layer ~20 tiny elementwise launches per step.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.runtime.attention.torch_backend import TorchAttnBackend
from services.worker.runtime.distributed import divide, get_tp_rank, get_tp_size
from services.worker.runtime.layers import gdn_ops
from services.worker.runtime.layers.fp8 import Fp8BlockWeight
from services.worker.runtime.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_weight_shape,
    default_weight_loader,
    full_weight,
    narrow_weight,
    new_parameter,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from services.worker.runtime.forward_batch import ForwardBatch


class _TritonOps:
    """The Triton kernels under gdn_ops' names, imported at first use: triton is needed (and installed)
    only where a GPU backend runs (or under the interpreter in tests)."""

    def __init__(self) -> None:
        from kernels import causal_conv1d, gated_delta_rule, gated_rms_norm

        self.causal_conv1d_fwd = causal_conv1d.causal_conv1d_fwd
        self.causal_conv1d_update = causal_conv1d.causal_conv1d_update
        self.chunk_gated_delta_rule = gated_delta_rule.chunk_gated_delta_rule
        self.fused_recurrent_gated_delta_rule_update = (
            gated_delta_rule.fused_recurrent_gated_delta_rule_update
        )
        self.fused_sigmoid_gating_delta_rule_update = (
            gated_delta_rule.fused_sigmoid_gating_delta_rule_update
        )
        self.gated_rms_norm = gated_rms_norm.gated_rms_norm


_triton_ops: _TritonOps | None = None


def gdn_ops_for(batch: ForwardBatch) -> ModuleType | _TritonOps:
    """gdn_ops (torch) on the torch attention backend, the Triton kernels on any other."""
    global _triton_ops
    if isinstance(batch.attn_backend, TorchAttnBackend):
        return gdn_ops
    if _triton_ops is None:
        _triton_ops = _TritonOps()
    return _triton_ops


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * silu(gate) per head (transformers' Qwen3_5RMSNormGated, rounding included:
    the norm in float32, the scale in the input dtype, the gate in float32), by `ops`' gated_rms_norm:
    gdn_ops' torch form by default, the Triton kernel's on the GPU backends."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((head_dim,), default_weight_loader)
        nn.init.ones_(self.weight)

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, ops: ModuleType | _TritonOps = gdn_ops
    ) -> torch.Tensor:
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNetInProj(MergedColumnParallelLinear):
    """in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one column-parallel product: output_sizes
    [q, k, v, z, b, a], each split across ranks. The checkpoint's in_proj_qkv (shard 'qkv') fills the
    first three; z, b and a are shards 3, 4 and 5.

    FP8 (layers/fp8_weights.py): the published Qwen3.5 FP8 checkpoints quantize in_proj_qkv and in_proj_z
    but keep in_proj_b and in_proj_a in bf16 (modules_to_not_convert), so the last two shards stay in
    the model's dtype (`fp8_plain_shards`) beside the FP8 q/k/v/z rows."""

    fp8_plain_shards = 2
    fused_shards = {"qkv": (0, 1, 2)}

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: int | str | None = None) -> None:
        if shard_id != "qkv":
            super().weight_loader(param, loaded_weight, shard_id)
            return
        check_weight_shape(loaded_weight, (sum(self.output_sizes[:3]), self.input_size), "linear_attn.in_proj_qkv")
        if isinstance(loaded_weight, Fp8BlockWeight):
            # Dequantized whole: k and v need not start on a block boundary of in_proj_qkv.
            loaded_weight = loaded_weight[:]
        start = 0
        for index, rows in enumerate(self.output_sizes[:3]):
            super().weight_loader(param, narrow_weight(loaded_weight, 0, start, rows), index)
            start += rows


def _split_rows(loaded_weight: LoadedWeight, sizes: list[int], what: str) -> torch.Tensor:
    """This rank's rows of each consecutive block of `sizes` rows (q, k, v channels; v heads), joined."""
    tp_rank, tp_size = get_tp_rank(), get_tp_size()
    weight = full_weight(loaded_weight)
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"checkpoint tensor for {what} has {weight.shape[0]} rows, expected {sum(sizes)}")
    parts, start = [], 0
    for size in sizes:
        local = divide(size, tp_size)
        parts.append(weight[start + tp_rank * local : start + (tp_rank + 1) * local])
        start += size
    return torch.cat(parts)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `state_id` is its index among the model's linear layers (its
    StatePool tensors)."""

    def __init__(self, hf: PretrainedConfig, hidden_size: int, state_id: int) -> None:
        super().__init__()
        self.state_id = state_id
        total_k_heads, total_v_heads = int(hf.linear_num_key_heads), int(hf.linear_num_value_heads)
        if total_v_heads % total_k_heads:
            raise ValueError(
                f"linear_num_value_heads={total_v_heads} must be a multiple of linear_num_key_heads={total_k_heads}"
            )
        tp_size = get_tp_size()
        if total_k_heads % tp_size:
            raise ValueError(f"linear_num_key_heads={total_k_heads} is not divisible by tp_size={tp_size}")
        # This rank's heads: its share of the q/k heads and of the v heads they serve.
        self.num_k_heads = total_k_heads // tp_size
        self.num_v_heads = total_v_heads // tp_size
        self.head_k_dim = int(hf.linear_key_head_dim)
        self.head_v_dim = int(hf.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = int(hf.linear_conv_kernel_dim)
        self.activation = str(hf.hidden_act)
        self.scale = self.head_k_dim**-0.5
        total_key, total_value = total_k_heads * self.head_k_dim, total_v_heads * self.head_v_dim
        self.in_proj = GatedDeltaNetInProj(
            hidden_size, [total_key, total_key, total_value, total_value, total_v_heads, total_v_heads]
        )
        self._conv_blocks = [total_key, total_key, total_value]
        self.conv_weight = new_parameter((self.conv_dim, self.conv_width), self._load_conv_weight)
        self.dt_bias = new_parameter((self.num_v_heads,), self._load_per_head)
        self.A_log = new_parameter((self.num_v_heads,), self._load_per_head)
        self.norm = GatedRMSNorm(self.head_v_dim, float(hf.rms_norm_eps))
        self.out_proj = RowParallelLinear(total_value, hidden_size)

    def _load_conv_weight(self, param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
        """The checkpoint's nn.Conv1d weight [C, 1, W] (or [C, W]): this rank's q, k and v channels."""
        weight = full_weight(loaded_weight)
        weight = weight[:, 0] if weight.dim() == 3 else weight
        weight = _split_rows(weight, self._conv_blocks, "linear_attn.conv1d")
        check_weight_shape(weight, tuple(param.shape), "linear_attn.conv1d (this rank's channels)")
        param.data.copy_(weight)

    def _load_per_head(self, param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
        param.data.copy_(_split_rows(loaded_weight, [self.num_v_heads * get_tp_size()], "a per-v-head parameter"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.state_metadata
        if meta is None:
            raise ValueError("a linear-attention layer needs batch.state_metadata (HybridReqToTokenPool)")
        conv_state, recurrent_state = meta.state_pool.layer(self.state_id)
        # This rank's [q | k | v | z | b | a]: the first three are the conv input, in the conv's order.
        mixed, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        ops = gdn_ops_for(batch)
        decode = batch.forward_mode.is_decode()
        track = meta.track
        if track is not None:  # the window before each tracked last token, read before the conv moves on
            window = track.conv_window(mixed, conv_state, meta.state_indices[track.seqs])
        if decode:
            mixed = ops.causal_conv1d_update(
                mixed, self.conv_weight, None, conv_state=conv_state, state_indices=meta.state_indices,
                activation=self.activation,
            )
        else:
            mixed = ops.causal_conv1d_fwd(
                mixed, self.conv_weight, None, conv_state=conv_state, state_indices=meta.state_indices,
                cu_seqlens=meta.cu_seqlens, has_initial_state=meta.has_initial_state, activation=self.activation,
            )
        tokens = hidden.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        if decode:
            core = ops.fused_sigmoid_gating_delta_rule_update(
                q, k, v, a, b, self.A_log, self.dt_bias, state=recurrent_state,
                state_indices=meta.state_indices, scale=self.scale,
            )
        else:
            g, beta = gdn_ops.sigmoid_gating(a, b, self.A_log, self.dt_bias)
            if track is not None:
                # Tracked sequences stop one token short (that token's decay and write zeroed: it leaves
                # the state as it is); their state there is saved, then the one-token update ends them.
                last = track.last_rows
                g_last, beta_last = g[last], beta[last]
                g, beta = g.index_fill(0, last, 0.0), beta.index_fill(0, last, 0.0)
            core = ops.chunk_gated_delta_rule(
                q, k, v, g, beta, state=recurrent_state, state_indices=meta.state_indices,
                cu_seqlens=meta.cu_seqlens, scale=self.scale,
            )
            if track is not None:
                rows = meta.state_indices[track.seqs]
                track.save(self.state_id, window, recurrent_state[rows])
                core[last] = ops.fused_recurrent_gated_delta_rule_update(
                    q[last],
                    k[last],
                    v[last],
                    g_last,
                    beta_last,
                    state=recurrent_state,
                    state_indices=rows,
                    scale=self.scale,
                )
        # Per head: z viewed as [T, Hv, Dv] in place (a strided slice of the in_proj output, not copied).
        out = self.norm(core, z.view(tokens, self.num_v_heads, self.head_v_dim), ops)
        return self.out_proj(out.reshape(tokens, self.value_dim))
