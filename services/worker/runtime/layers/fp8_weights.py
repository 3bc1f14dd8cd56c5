"""FP8-resident weights: which layers keep their weights in FP8, those parameters, and how they fill.

A resident layer holds `weight` in torch.float8_e4m3fn beside a float32 `weight_scale_inv`
[ceil(N / bn), ceil(K / bk)] (FusedMoE: `w13_weight` / `w13_weight_scale_inv` [E, ceil(2I / bn),
ceil(H / bk)] and `w2_weight` / `w2_weight_scale_inv` [E, ceil(H / bn), ceil(I / bk)]), the published
layout of layers/fp8.py, and multiplies through its `quant_method` (Fp8LinearMethod; FusedMoE through
the fused_moe kernel or the dequantizing reference). Two ways in, chosen by model_loader.py:

- An FP8 checkpoint (`make_fp8_resident`, before loading): every column- or row-parallel linear layer
  and FusedMoE whose checkpoint weights carry a weight_scale_inv gets FP8 parameters and loaders that
  copy this rank's fp8 rows or columns, and the scales of their blocks, unchanged. Fused matrices (q/k/v,
  gate/up, an expert's w1/w3) stack their shards' blocks, so every shard and every TP rank's slice must
  start on a block boundary (vLLM requires the same); that is checked here, before a weight is read.
  A fused column-parallel layer with `fp8_plain_shards` (Qwen3.5's Gated DeltaNet in_proj: q/k/v/z
  then b/a, which the published FP8 checkpoints leave in bf16) keeps its leading shards in FP8 and the
  trailing ones in `weight_tail`, in the model's dtype (Fp8HeadLinearMethod); its `fused_shards` (the
  checkpoint's in_proj_qkv filling q, k and v) load block by block like the others. Layers of other
  kinds with loaders of their own load dequantized.
- `--quantization fp8` on an unquantized checkpoint (`quantize_fp8_after_load`): the model loads in its
  dtype, then every column- and row-parallel linear layer and every FusedMoE is quantized with
  quantize_blocks over this rank's (fused) matrix, and its full-precision weight freed (SGLang's
  process_weights_after_loading; loading therefore needs the unquantized weights' memory once). As in
  the published checkpoints the embeddings, norms, LM head, MoE router and other replicated layers
  (shared-expert gates) stay unquantized, and so do the `fp8_plain_shards` (the Gated DeltaNet's b/a).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from services.worker.runtime.layers.fp8 import (
    FP8_DTYPE,
    Fp8BlockWeight,
    Fp8HeadLinearMethod,
    Fp8LinearMethod,
    quantize_blocks,
)
from services.worker.runtime.layers.linear import (
    ColumnParallelLinear,
    LoadedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    check_weight_shape,
    full_weight,
)
from services.worker.runtime.layers.moe import FusedMoE

# The layers whose loaders make_fp8_resident reproduces for FP8 tensors (exact types: a subclass with a
# loader of its own, like GatedDeltaNetInProj, loads dequantized).
CHECKPOINT_RESIDENT_TYPES = (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    FusedMoE,
)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (FP8 weights at one byte each, their scales at four)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_fp8_resident(model: nn.Module, quantized: Iterable[str], block_size: tuple[int, int]) -> list[str]:
    """Give the layers that the checkpoint's quantized weights (HF names, those with a weight_scale_inv)
    load into FP8 parameters and loaders; returns the layers' names. ValueError when a fused shard or a
    TP rank's slice would start mid-block."""
    modules = dict(model.named_modules())
    targets: dict[str, nn.Module] = {}
    for name in quantized:
        if model.skip_weight(name):  # another pipeline stage's, or one the model never loads
            continue
        param_name, _ = model.weight_target(name)
        module_name = param_name.rsplit(".", 1)[0]
        module = modules.get(module_name)
        if module is not None and (type(module) in CHECKPOINT_RESIDENT_TYPES or _plain_shards(module)):
            targets[module_name] = module
    for name, module in sorted(targets.items()):
        if _plain_shards(module):
            _resident_head(name, module, block_size)
        elif isinstance(module, FusedMoE):
            _resident_experts(name, module, block_size)
        elif isinstance(module, RowParallelLinear):
            _resident_row(name, module, block_size)
        else:
            _resident_column(name, module, block_size)
    return sorted(targets)


def quantize_fp8_after_load(model: nn.Module, block_size: tuple[int, int]) -> list[str]:
    """Quantize every loaded column/row-parallel linear layer and FusedMoE in place (quantize_blocks on
    its device); returns the layers' names."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            for param in ("w13_weight", "w2_weight"):
                weight, scale = quantize_blocks(getattr(module, param).data, block_size)
                _replace(module, param, weight, scale, getattr(module, param).weight_loader)
            module.fp8_block_size = block_size
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            full, rows = module.weight.data, _fp8_rows(module)
            weight, scale = quantize_blocks(full[:rows], block_size)
            if rows < full.shape[0]:  # the fp8_plain_shards stay as they are
                module.weight_tail = nn.Parameter(full[rows:].clone(), requires_grad=False)
            _replace(module, "weight", weight, scale, module.weight.weight_loader)
            _mark_fp8_linear(module, block_size, tail=rows < full.shape[0])
        else:
            continue
        done.append(name)
    return done


def _replace(
    module: nn.Module, name: str, weight: torch.Tensor, scale: torch.Tensor, loader: Callable[..., None]
) -> None:
    """module.<name> := weight (FP8) and module.<name>_scale_inv := scale, as inference parameters."""
    param = nn.Parameter(weight, requires_grad=False)
    param.weight_loader = loader
    setattr(module, name, param)
    setattr(module, name + "_scale_inv", nn.Parameter(scale, requires_grad=False))


def _empty_fp8(
    module: nn.Module,
    name: str,
    block_size: tuple[int, int],
    loader: Callable[..., None],
    rows: int | None = None,
) -> None:
    """Replace module.<name> by an unfilled FP8 parameter of its shape (its first `rows` rows) and NaN
    scales (a block no checkpoint tensor fills shows as NaN, not as plausible numbers)."""
    old = getattr(module, name)
    *lead, n, k = old.shape
    n = n if rows is None else rows
    weight = torch.empty((*lead, n, k), dtype=FP8_DTYPE, device=old.device)
    scale = torch.full(
        (*lead, math.ceil(n / block_size[0]), math.ceil(k / block_size[1])), math.nan, device=old.device
    )
    _replace(module, name, weight, scale, loader)


def _plain_shards(module: nn.Module) -> int:
    """How many trailing shards of a fused column-parallel layer stay unquantized (0: none)."""
    return int(getattr(module, "fp8_plain_shards", 0)) if isinstance(module, ColumnParallelLinear) else 0


def _fp8_rows(module: ColumnParallelLinear | RowParallelLinear) -> int:
    """This rank's rows of the layer that go FP8: all but those of its fp8_plain_shards."""
    plain = _plain_shards(module)
    return module.weight.shape[0] if not plain else sum(module.local_sizes[:-plain])


def _mark_fp8_linear(module: nn.Module, block_size: tuple[int, int], tail: bool = False) -> None:
    module.quant_method = Fp8HeadLinearMethod(block_size) if tail else Fp8LinearMethod(block_size)
    module.prepackable = False  # no oneDNN copy nor GEMV tiles: the FP8 product reads the weight


def _check_slice(what: str, start: int, length: int, total: int, block: int, axis: str) -> None:
    """A checkpoint slice [start, start + length) of `total` rows/columns starts on a block boundary and
    ends on one or at the tensor's end."""
    stop = start + length
    if start % block or (stop % block and stop != total):
        raise ValueError(
            f"{what}: this rank's {axis} [{start}, {stop}) of {total} do not align with the FP8 weight_block_size "
            f"{block}: the tensor-parallel split must fall on block boundaries (use a tp_size that splits this "
            f"dimension into whole {block}-wide blocks)"
        )


def _check_offset(what: str, shard: Any, offset: int, block: int) -> None:
    """A fused shard's first row in the layer's matrix is a block boundary (its scales stack below the
    previous shard's)."""
    if offset % block:
        raise ValueError(
            f"{what}: shard {shard!r} starts at row {offset} of the fused FP8 matrix, not on a boundary of its "
            f"{block}-row blocks: each fused matrix (q/k/v, gate/up) must hold whole blocks on every rank to "
            "stay FP8 (use a tp_size that splits it into whole blocks)"
        )


def _copy_blocks(
    weight: torch.Tensor,
    scale: torch.Tensor,
    loaded: LoadedWeight,
    dim: int,
    offset: int,
    start: int,
    length: int,
    what: str,
) -> None:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of an FP8 checkpoint tensor into
    weight[offset:] along dim, and their blocks' scales into scale at offset's block."""
    if not isinstance(loaded, Fp8BlockWeight):
        raise ValueError(
            f"{what}: this checkpoint tensor has no weight_scale_inv, but the layer it loads into keeps FP8 "
            "weights (another tensor fused into it is FP8): fused tensors must be all quantized or all not"
        )
    index = [slice(None), slice(None)]
    index[dim] = slice(start, start + length)
    values, scales = loaded.blocks(tuple(index))
    weight.narrow(dim, offset, length).copy_(values)
    scale.narrow(dim, offset // loaded.block_size[dim], scales.shape[dim]).copy_(scales)


def _shard_ids(module: ColumnParallelLinear) -> list[Any]:
    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    return list(range(len(module.output_sizes)))


def _resident_column(name: str, module: ColumnParallelLinear, block_size: tuple[int, int]) -> None:
    bn = block_size[0]
    for shard in _shard_ids(module):
        offset, rows, start, total = module.shard_range(shard)
        _check_slice(f"{name} shard {shard!r}", start, rows, total, bn, "rows")
        _check_offset(name, shard, offset, bn)
    columns = module.input_size

    def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: int | str | None = None) -> None:
        offset, rows, start, total = module.shard_range(shard_id)
        check_weight_shape(loaded, (total, columns), f"{type(module).__name__} shard {shard_id}")
        _copy_blocks(
            param.data,
            module.weight_scale_inv.data,
            loaded,
            0,
            offset,
            start,
            rows,
            f"{name} shard {shard_id}",
        )

    _empty_fp8(module, "weight", block_size, load)
    _mark_fp8_linear(module, block_size)


def _resident_row(name: str, module: RowParallelLinear, block_size: tuple[int, int]) -> None:
    cols = module.input_size_per_partition
    start = module.tp_rank * cols
    _check_slice(name, start, cols, module.input_size, block_size[1], "columns")

    def load(param: nn.Parameter, loaded: LoadedWeight) -> None:
        check_weight_shape(loaded, (param.shape[0], module.input_size), type(module).__name__)
        _copy_blocks(param.data, module.weight_scale_inv.data, loaded, 1, 0, start, cols, name)

    _empty_fp8(module, "weight", block_size, load)
    _mark_fp8_linear(module, block_size)


def _resident_experts(name: str, module: FusedMoE, block_size: tuple[int, int]) -> None:
    rows, total = module.intermediate_per_rank, module.intermediate_size
    start = module.tp_rank * rows
    _check_slice(f"{name}.w13_weight", start, rows, total, block_size[0], "rows")
    _check_slice(f"{name}.w2_weight", start, rows, total, block_size[1], "columns")
    _check_offset(f"{name}.w13_weight", "w3", rows, block_size[0])

    def load(param: nn.Parameter, loaded: LoadedWeight, expert_id: int, shard_id: str) -> None:
        if not 0 <= expert_id < module.num_experts:
            raise ValueError(f"expert id {expert_id} is outside num_experts={module.num_experts}")
        what = f"{name} expert {expert_id} {shard_id}"
        if shard_id == "w2":
            check_weight_shape(loaded, (module.hidden_size, total), "expert down_proj")
            weight, scale = module.w2_weight.data[expert_id], module.w2_weight_scale_inv.data[expert_id]
            _copy_blocks(weight, scale, loaded, 1, 0, start, rows, what)
            return
        check_weight_shape(loaded, (total, module.hidden_size), f"expert {shard_id}")
        weight, scale = module.w13_weight.data[expert_id], module.w13_weight_scale_inv.data[expert_id]
        _copy_blocks(weight, scale, loaded, 0, 0 if shard_id == "w1" else rows, start, rows, what)

    _empty_fp8(module, "w13_weight", block_size, load)
    _empty_fp8(module, "w2_weight", block_size, load)
    module.fp8_block_size = block_size


def _resident_head(name: str, module: ColumnParallelLinear, block_size: tuple[int, int]) -> None:
    """A fused column-parallel layer with fp8_plain_shards: its leading shards FP8 (each checked to hold
    whole blocks, as _resident_column), the trailing ones copied into `weight_tail` in the model's dtype
    (dequantized should a checkpoint have quantized them); a checkpoint tensor named in `fused_shards`
    fills its shards in order."""
    bn, plain = block_size[0], _plain_shards(module)
    fp8_shards = len(module.output_sizes) - plain
    for shard in range(fp8_shards):
        offset, rows, start, total = module.shard_range(shard)
        _check_slice(f"{name} shard {shard!r}", start, rows, total, bn, "rows")
        _check_offset(name, shard, offset, bn)
    head = _fp8_rows(module)
    fused: dict[Any, tuple[int, ...]] = getattr(module, "fused_shards", {})
    columns = module.input_size

    def load_shard(loaded: LoadedWeight, index: int, base: int) -> None:
        offset, rows, start, _ = module.shard_range(index)
        if index >= fp8_shards:
            tail = full_weight(loaded)[base + start : base + start + rows]
            module.weight_tail.data.narrow(0, offset - head, rows).copy_(tail)
            return
        what = f"{name} shard {index}"
        _copy_blocks(
            module.weight.data, module.weight_scale_inv.data, loaded, 0, offset, base + start, rows, what
        )

    def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: int | str | None = None) -> None:
        parts = fused[shard_id] if shard_id in fused else (0 if shard_id is None else int(shard_id),)
        check_weight_shape(
            loaded, (sum(module.output_sizes[i] for i in parts), columns), f"{name} shard {shard_id}"
        )
        base = 0
        for index in parts:
            load_shard(loaded, index, base)
            base += module.output_sizes[index]

    old = module.weight
    module.weight_tail = nn.Parameter(torch.empty_like(old.data[head:]), requires_grad=False)
    _empty_fp8(module, "weight", block_size, load, rows=head)
    _mark_fp8_linear(module, block_size, tail=True)
