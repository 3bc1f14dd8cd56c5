"""A Llama-shaped decoder layer's decode step as one C++ op on the CPU (kernels/cpu/layer_row.cpp): the same
registered ops the layer calls one by one, in one call instead of the Python, module lookups and tensor
bookkeeping between them (~45 us a layer at batch 1; at batch 16 ~30 small calls a layer).

    step = row_decode_step(batch, hidden)              # None unless this step qualifies
    out = layer_row(layer, hidden, residual, step)       # None unless this layer qualifies

At batch 1, decoder_layer_row: the fused norm + C++ product, the q/k norm + rotation, the KV store, the batch
attention over the pool's slots, SiLU-and-mul + product. At batch 2 and more, decoder_layer_rows: the row ops
of kernels/cpu/rows.cpp, oneDNN's packed products (as linear() takes several rows) and the attention over
what the torch backend reads this step, the dense blocks (attention/dense_kv.py, this step's rows appended)
or the pool's slots; a step that regathers the blocks runs the modules. decoder_layer_rows also takes a lone
row whose products are not the C++ ones: on the packed weights, or on the plain ones where calibration chose
F.linear for single rows (without this, such a layer ran module by module: on a 2-vCPU Intel Xeon, SmolLM2's
batch-1 step 33.0 ms on F.linear against 26.9 on the C++ product, whose pass alone was 5 % slower).

A step qualifies on the CPU in float32 or bfloat16 (every op of the layer takes either, rounding bfloat16
where torch's bfloat16 ops round) with one tensor-parallel rank, the library loaded and the torch backend's
C++ decode attention in use (`rows`, or a lone request's consecutive slots); a layer when it is a plain
Llama/Qwen3 layer (LlamaMLP, RMSNorms, no biases, no quantization, not batch-invariant) whose products take
its rows as the step-by-step path would (the C++ product for one row, the packed weight for more, F.linear on
the weight for one row where calibration chose it).
RS_CPU_LAYER_ROW=0 turns it off, as does RS_CPU_ROW_ATTENTION=0 (its attention is the C++ batch op).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from services.worker.runtime.distributed import get_tp_size
from services.worker.runtime.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from services.worker.runtime.attention.dense_kv import DenseStep
    from services.worker.runtime.forward_batch import ForwardBatch

LAYER_ROW_ENV = "RS_CPU_LAYER_ROW"


@dataclass(frozen=True)
class RowDecodeStep:
    slots: torch.Tensor  # [bs, max_len] int64: the keys' rows the attention reads (pool slots or dense rows)
    seq_lens: torch.Tensor  # [bs] int64
    loc: torch.Tensor  # [bs] int64, the new tokens' slots
    positions: torch.Tensor  # [bs] int64
    # Batch >= 2 with the dense blocks: the step's (keys, values per layer, and the rows this step's go to).
    dense: DenseStep | None = None


def row_decode_step(batch: ForwardBatch, hidden: torch.Tensor) -> RowDecodeStep | None:
    """The step's inputs for decoder_layer_row, or None where the step does not qualify (module docstring)."""
    # The backend imports layers; RS_CPU_ROW_ATTENTION=0 (no C++ attention) turns this path off too.
    from services.worker.runtime.attention.torch_backend import DecodeMetadata, _rows_attention

    meta = batch.attn_metadata
    if (
        not isinstance(meta, DecodeMetadata)
        or hidden.dim() != 2
        or hidden.shape[0] != batch.batch_size
        or not (meta.rows or (batch.batch_size == 1 and meta.first_slot is not None))
        or (meta.dense is not None and (batch.batch_size == 1 or meta.dense.fill_slots is not None))
        or hidden.dtype not in (torch.float32, torch.bfloat16)
        or hidden.device.type != "cpu"
        or batch.token_to_kv_pool.dtype != hidden.dtype
        or os.environ.get(LAYER_ROW_ENV, "1") == "0"
        or get_tp_size() != 1
        or _rows_attention(batch.token_to_kv_pool) is None
    ):
        return None
    from kernels.cpu_matvec import row_ops  # imported where used: the CPU library's module

    if row_ops() is None:
        return None
    if meta.dense is not None:
        return RowDecodeStep(meta.row_slots, batch.seq_lens, batch.out_cache_loc, batch.positions, meta.dense)
    return RowDecodeStep(meta.slots, batch.seq_lens, batch.out_cache_loc, batch.positions)


def _weights(layer: Any, hidden: torch.Tensor) -> tuple[bool, tuple[Any, ...]] | None:
    """(whether the row op takes it, the layer's operands): decoder_layer_row's for one row whose products
    are the C++ ones (the weights), else decoder_layer_rows' (the packed weights: several rows, or one row
    where calibration chose the packed product for single rows). Cached on the layer and checked against its
    current parameters; None where the layer does not qualify."""
    single = hidden.shape[0] == 1 and layer.self_attn.qkv_proj.cpu_single_row(hidden)
    qkv = layer.self_attn.qkv_proj.weight
    cached = getattr(layer, "_row_weights", None)
    if cached is None or cached[0] is not qkv:
        cached = layer._row_weights = (qkv, {})
    key = (single, hidden.shape[0] == 1)  # a lone row takes the packed weights only where calibration chose them
    operands = cached[1].get(key)
    if operands is None:  # not cached: a layer that does not qualify now may later (calibration, prepacking)
        operands = _operands(layer, hidden, single)
        if operands is None:
            return None
        cached[1][key] = operands
    return single, operands


def _plain_row(lin: Any, x: torch.Tensor) -> bool:
    """Whether one float32 or bfloat16 row x of this prepacked projection (or one marked cpu_rows) goes
    through F.linear on its weight (layers/linear.py's linear()): calibration chose neither the C++ product
    nor the packed weight for single rows, and the layer is not batch-invariant."""
    if lin.gemv_tiles is not None or lin.batch_invariant or (lin.packed_weight is None and not lin.cpu_rows):
        return False
    if x.dim() != 2 or x.shape[0] != 1 or lin.cpu_single_row(x) or lin.cpu_packed_rows(x):
        return False
    return lin.weight.dtype == x.dtype and x.dtype in (torch.float32, torch.bfloat16)


def _operands(layer: Any, hidden: torch.Tensor, single: bool) -> tuple[Any, ...] | None:
    """What _weights caches: the operands after the layer's checks, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    if not getattr(layer, "plain_mlp", False):  # models/llama.py: a LlamaMLP (SiLU-and-mul, gate_up, down)
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    if any(lin.bias is not None or lin.quant_method is not None for lin in linears):
        return None
    if single:
        products = all(lin.cpu_single_row(hidden) for lin in linears)
    else:  # each product by its weight: the packed one, or for one row where F.linear won calibration the plain one
        products = all(lin.cpu_packed_rows(hidden) or _plain_row(lin, hidden) for lin in linears)
    if not products or getattr(mlp.act_fn, "batch_invariant", False):
        return None
    if any(n is not None and (type(n) is not RMSNorm or n.weight.dtype != hidden.dtype) for n in norms):
        return None
    if len({n.eps for n in norms if n is not None}) != 1:
        return None
    qkv, o, gate_up, down = (
        lin.packed_weight if not single and lin.cpu_packed_rows(hidden) else lin.weight for lin in linears
    )
    rope = attn.rotary_emb
    return (
        layer.input_layernorm.weight,
        qkv,
        attn.q_norm.weight if attn.q_norm is not None else None,
        attn.k_norm.weight if attn.k_norm is not None else None,
        o,
        layer.post_attention_layernorm.weight,
        gate_up,
        down,
        attn.attn.layer_id,
        rope.cos_cache,
        rope.sin_cache,
        layer.input_layernorm.eps,
        attn.attn.scaling,
        attn.num_kv_heads,
        attn.head_dim,
    )


def layer_row(
    layer: Any, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, step: RowDecodeStep
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden, residual) after `layer` through decoder_layer_row (one row) or decoder_layer_rows, or None
    where the layer does not qualify (the caller runs it as usual)."""
    weights = _weights(layer, hidden)
    if weights is None:
        return None
    single, operands = weights
    in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, kv_layer, cos, sin, eps, scale, kv_heads, d = operands
    pool = batch.token_to_kv_pool
    k_pool, v_pool = pool.get_key_buffer(kv_layer), pool.get_value_buffer(kv_layer)
    if single:
        return torch.ops.radixserve_cpu.decoder_layer_row(
            hidden, residual, in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, k_pool, v_pool,
            step.slots, step.seq_lens, step.loc, step.positions, cos, sin, eps, scale, kv_heads, d,
        )  # fmt: skip
    if step.dense is not None:  # the blocks as [bs * capacity, kv_heads, head_dim] rows; this step's appended
        k_read = step.dense.keys[kv_layer].view(-1, kv_heads, d)
        v_read = step.dense.values[kv_layer].view(-1, kv_heads, d)
        new_rows = step.dense.new_rows
    else:
        k_read, v_read, new_rows = k_pool, v_pool, None
    return torch.ops.radixserve_cpu.decoder_layer_rows(
        hidden, residual, in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down, k_pool, v_pool,
        step.loc, step.positions, cos, sin, k_read, v_read, step.slots, step.seq_lens, new_rows, eps, scale,
        kv_heads, d,
    )  # fmt: skip
