"""A Llama-shaped decoder layer's batch-1 decode step as one C++ op on the CPU (kernels/cpu/layer_row.cpp's
decoder_layer_row): the same registered ops the layer calls one by one at batch 1 (the fused norm + product,
the q/k norm + rotation, the KV store, the batch attention over the pool's slots, SiLU-and-mul + product),
in one call instead of ~45 us of Python, module lookups and tensor bookkeeping a layer.

    step = row_decode_step(batch, hidden)              # None unless this step qualifies
    out = layer_row(layer, hidden, residual, step)       # None unless this layer qualifies

A step qualifies on the CPU in float32 at batch 1 with one tensor-parallel rank, the library loaded and the
torch backend reading this request's keys from the pool through its slots (TorchAttnBackend leaves a lone
float32 request there); a layer when it is a plain Llama/Qwen3 layer (LlamaMLP, RMSNorms, no biases, no
quantization) whose products take single rows through the C++ product. RS_CPU_LAYER_ROW=0 turns it off, as
does RS_CPU_ROW_ATTENTION=0 (its attention is the C++ batch op).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.worker.runtime.distributed import get_tp_size
from services.worker.runtime.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch

LAYER_ROW_ENV = "RS_CPU_LAYER_ROW"


@dataclass(frozen=True)
class RowDecodeStep:
    slots: torch.Tensor  # [1, seq_len] int64
    seq_lens: torch.Tensor  # [1] int64
    loc: torch.Tensor  # [1] int64, the new token's slot
    positions: torch.Tensor  # [1] int64


def row_decode_step(batch: ForwardBatch, hidden: torch.Tensor) -> RowDecodeStep | None:
    """The step's inputs for decoder_layer_row, or None where the step does not qualify (module docstring)."""
    # The backend imports layers; RS_CPU_ROW_ATTENTION=0 (no C++ attention) turns this path off too.
    from services.worker.runtime.attention.torch_backend import DecodeMetadata, _rows_attention

    meta = batch.attn_metadata
    if (
        batch.batch_size != 1
        or not isinstance(meta, DecodeMetadata)
        or not (meta.rows or meta.first_slot is not None)
        or meta.dense is not None
        or hidden.dtype != torch.float32
        or hidden.device.type != "cpu"
        or batch.token_to_kv_pool.dtype != torch.float32
        or os.environ.get(LAYER_ROW_ENV, "1") == "0"
        or get_tp_size() != 1
        or _rows_attention(batch.token_to_kv_pool) is None
    ):
        return None
    from kernels.cpu_matvec import row_ops  # imported where used: the CPU library's module

    if row_ops() is None:
        return None
    return RowDecodeStep(meta.slots, batch.seq_lens, batch.out_cache_loc, batch.positions)


def _weights(layer: Any, hidden: torch.Tensor) -> tuple[Any, ...] | None:
    """The layer's operands for decoder_layer_row (cached on the layer, checked against its current
    parameters), or None where it does not qualify."""
    attn, mlp = layer.self_attn, layer.mlp
    cached = getattr(layer, "_row_weights", None)
    if cached is not None and cached[0] is attn.qkv_proj.weight:
        return cached[1]
    if not getattr(layer, "plain_mlp", False):  # models/llama.py: a LlamaMLP (SiLU-and-mul, gate_up, down)
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    if any(lin.bias is not None or lin.quant_method is not None or not lin.cpu_single_row(hidden) for lin in linears):
        return None
    if any(n is not None and (type(n) is not RMSNorm or n.weight.dtype != torch.float32) for n in norms):
        return None
    if len({n.eps for n in norms if n is not None}) != 1:
        return None
    rope = attn.rotary_emb
    operands = (
        layer.input_layernorm.weight,
        attn.qkv_proj.weight,
        attn.q_norm.weight if attn.q_norm is not None else None,
        attn.k_norm.weight if attn.k_norm is not None else None,
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight,
        mlp.down_proj.weight,
        attn.attn.layer_id,
        rope.cos_cache,
        rope.sin_cache,
        layer.input_layernorm.eps,
        attn.attn.scaling,
        attn.num_kv_heads,
        attn.head_dim,
    )
    layer._row_weights = (attn.qkv_proj.weight, operands)
    return operands


def layer_row(
    layer: Any, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, step: RowDecodeStep
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden, residual) after `layer` through decoder_layer_row, or None where the layer does not qualify
    (the caller runs it as usual)."""
    operands = _weights(layer, hidden)
    if operands is None:
        return None
    in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, kv_layer, cos, sin, eps, scale, kv_heads, d = operands
    pool = batch.token_to_kv_pool
    return torch.ops.radixserve_cpu.decoder_layer_row(
        hidden, residual, in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down,
        pool.get_key_buffer(kv_layer), pool.get_value_buffer(kv_layer),
        step.slots, step.seq_lens, step.loc, step.positions, cos, sin, eps, scale, kv_heads, d,
    )  # fmt: skip
