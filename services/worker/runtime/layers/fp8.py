"""FP8 checkpoints as published (Qwen3 / Qwen3-MoE "-FP8"): block-wise e4m3 weights, loaded dequantized.

Such a checkpoint's config.json carries transformers' FineGrainedFP8 `quantization_config`:
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`
(optionally `modules_to_not_convert`). Every quantized linear weight `<name>.weight` [N, K] is stored as
torch.float8_e4m3fn beside `<name>.weight_scale_inv`, float32 [ceil(N / bn), ceil(K / bk)]: the weight of
block (i, j) is its fp8 values times scale_inv[i, j] (edge blocks may be partial). Everything else
(embeddings, norms, lm_head, the MoE router, the modules_to_not_convert) is stored unquantized.

This is the reference path: `dequantize_fp8_weights` hands the model each quantized weight as a lazy
`Fp8BlockWeight`, which the layers' weight_loaders slice like any checkpoint tensor (column- or
row-parallel, per expert) and which dequantizes just that slice to float32, so the parameter holds the
dequantized weight in the model's compute dtype. It runs anywhere (CI tests it on the CPU). On the GPU a
block-scaled FP8 GEMM reading the fp8 weight and its scales will replace it; that kernel needs each TP
rank's slice to start on a block boundary, so the reference path refuses a split that does not (a slice
may end mid-block only at the tensor's end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.runtime.layers.linear import LoadedWeight, full_weight, weight_shape

SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's block-wise FP8 scheme: weight_block_size (rows, columns) of one scale. Which
    modules are quantized is read from the tensors (those with a weight_scale_inv), so
    modules_to_not_convert needs no handling: those weights are plain tensors and load as such."""

    block_size: tuple[int, int]


def parse_quantization_config(raw: dict[str, Any] | None) -> Fp8Config | None:
    """config.json's `quantization_config` -> Fp8Config (None: an unquantized checkpoint); anything this
    loader cannot run is refused here, before a weight is read."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; only block-wise 'fp8' checkpoints load"
        )
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; only 'e4m3' (torch.float8_e4m3fn)")
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={scheme!r} is not supported; only 'dynamic' (no input scales)"
        )
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} is not supported; only 'float' (float32)")
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quantization_config has no weight_block_size: per-tensor FP8 checkpoints are not supported, "
            "only block-wise ones (weight_block_size [rows, columns] with weight_scale_inv tensors)"
        )
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive integers")
    return Fp8Config(block_size=(block[0], block[1]))


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """weight (fp8 [n, k], starting on a block boundary) times its blocks' scale_inv, in float32."""
    bn, bk = block_size
    n, k = weight.shape
    scale = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.to(torch.float32) * scale


def _bounds(index: Any, size: int, block: int, what: str, dim: int) -> tuple[int, int]:
    """(start, stop) of a slice along one dim, checked to start on a block boundary and to end on one
    or at the tensor's end."""
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise TypeError(f"FP8 weight {what} takes plain slices, got {index!r}")
    start, stop, _ = index.indices(size)
    if start % block or (stop % block and stop != size):
        raise ValueError(
            f"FP8 weight {what}: rows/columns [{start}, {stop}) of dim {dim} (size {size}) do not align with "
            f"weight_block_size {block}; the tensor-parallel split must fall on block boundaries (use a "
            f"tp_size that divides this dimension into whole {block}-wide blocks)"
        )
    return start, stop


class Fp8BlockWeight:
    """A quantized checkpoint weight and its scales, read and dequantized (float32) slice by slice:
    the same interface as a lazy safetensors slice (get_shape, [index]), so weight_loaders narrow it
    as they narrow any checkpoint tensor."""

    def __init__(self, name: str, weight: LoadedWeight, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> None:
        shape = weight_shape(weight)
        if len(shape) != 2:
            raise ValueError(f"FP8 weight {name!r} has shape {list(shape)}; block-wise FP8 weights are 2-D")
        expected = tuple(math.ceil(s / b) for s, b in zip(shape, block_size))
        if tuple(scale_inv.shape) != expected:
            raise ValueError(
                f"{name}{SCALE_SUFFIX.removeprefix('.weight')} has shape {list(scale_inv.shape)}, but weight "
                f"{list(shape)} in weight_block_size {list(block_size)} blocks needs {list(expected)}: "
                "the checkpoint's scales do not match its quantization_config.weight_block_size"
            )
        self.name, self.weight, self.scale_inv, self.block_size = name, weight, scale_inv.float(), block_size
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2:
            raise TypeError(f"FP8 weight {self.name!r} is 2-D, got index {index!r}")
        index = index + (slice(None),) * (2 - len(index))
        (r0, r1), (c0, c1) = (
            _bounds(i, size, block, repr(self.name), dim)
            for dim, (i, size, block) in enumerate(zip(index, self.shape, self.block_size))
        )
        bn, bk = self.block_size
        fp8 = self.weight[r0:r1, c0:c1]
        if fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.name!r} has a weight_scale_inv but is stored as {fp8.dtype}, not float8_e4m3fn")
        scale = self.scale_inv[r0 // bn : math.ceil(r1 / bn), c0 // bk : math.ceil(c1 / bk)]
        return dequantize_blocks(fp8, scale, self.block_size)


def read_scales(files: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """{weight name: its weight_scale_inv} from (name, lazy slice) pairs (the scales are small: one
    float per block)."""
    return {name.removesuffix("_scale_inv"): full_weight(w) for name, w in files if name.endswith(SCALE_SUFFIX)}


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, LoadedWeight]], scales: dict[str, torch.Tensor], config: Fp8Config
) -> Iterator[tuple[str, LoadedWeight]]:
    """The checkpoint's tensors as the model loads them: each fp8 weight wrapped with its scales in an
    Fp8BlockWeight (dequantized when a loader reads it), the scale tensors consumed, the rest unchanged.
    An fp8 weight without a scale, or a scale without its weight, is an error."""
    used: set[str] = set()
    for name, weight in weights:
        if name.endswith(SCALE_SUFFIX):
            continue
        if name in scales:
            used.add(name)
            yield name, Fp8BlockWeight(name, weight, scales[name], config.block_size)
            continue
        if _dtype(weight) in _FP8_DTYPES.values():
            raise ValueError(
                f"checkpoint tensor {name!r} is {_dtype(weight)} but has no {name.removesuffix('.weight')}"
                f"{SCALE_SUFFIX} beside it: a block-wise FP8 checkpoint needs one per quantized weight"
            )
        yield name, weight
    orphans = sorted(set(scales) - used)
    if orphans:
        raise ValueError(f"checkpoint has weight_scale_inv tensors without their weights: {orphans}")


def _dtype(weight: LoadedWeight) -> torch.dtype | None:
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    get_dtype = getattr(weight, "get_dtype", None)
    return None if get_dtype is None else _FP8_DTYPES.get(get_dtype())


# safetensors' names of the float8 dtypes.
_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
