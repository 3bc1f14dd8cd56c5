"""FP8 block-wise weights: the published checkpoint layout, the block math, and the FP8 linear product.

An FP8 checkpoint (Qwen3 / Qwen3-MoE "-FP8") carries transformers' FineGrainedFP8 `quantization_config`:
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`
(optionally `modules_to_not_convert`). Every quantized linear weight `<name>.weight` [N, K] is stored as
torch.float8_e4m3fn beside `<name>.weight_scale_inv`, float32 [ceil(N / bn), ceil(K / bk)]: the weight of
block (i, j) is its fp8 values times scale_inv[i, j] (edge blocks may be partial). Everything else
(embeddings, norms, lm_head, the MoE router, the modules_to_not_convert) is stored unquantized.
`--quantization fp8` makes the same layout from a bf16/f16/f32 checkpoint at load (`quantize_blocks`:
128x128 blocks, scale_inv = block amax / 448), so the same kernels run both.

Two ways to run such weights (ModelConfig.quantization.resident says which):
- resident (fp8_weights.py): the model keeps each quantized weight as float8_e4m3fn with its float32
  `weight_scale_inv` (half the bytes of bf16, a quarter of f32, plus one float per block), and
  `fp8_block_linear` multiplies with it: kernels/fp8_gemm.py's block-scaled GEMM on CUDA, elsewhere a
  torch reference that dequantizes the weight per call (float32 math). The default on CUDA.
- dequantized at load: `dequantize_fp8_weights` hands the model each quantized weight as a lazy
  `Fp8BlockWeight`, which the layers' weight_loaders slice like any checkpoint tensor (column- or
  row-parallel, per expert) and which dequantizes just that slice to float32, so the parameter holds the
  dequantized weight in the model's compute dtype. The default on the CPU: there the per-call
  dequantization costs more than the product itself (one pass converting every weight, then a float32
  product that cannot use the prepacked oneDNN weights: a 3072x1024 product took 6x as long at 16 rows
  and 17x at one row on the 2-vCPU CI host), and CPU serving is bound by compute, not by weight bytes.
  `--quantization fp8` selects the resident path on the CPU too (a quarter of the f32 memory), which is
  how CI tests it.

Either way a tensor-parallel rank's slice must start on a block boundary (the kernels read whole
blocks of scales), so a split that does not is refused (a slice may end mid-block only at the
tensor's end).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_reference import fp8_scale
from services.worker.config import QUANTIZATION_METHODS
from services.worker.runtime.layers.linear import LoadedWeight, full_weight, one_contiguous_row, weight_shape

# The most rows kernels/fp8_gemm.fp8_block_linear sends to a GEMV (its GEMV_MAX_ROWS; a test checks they
# agree): more rows take the w8a8 GEMM, whose rows a norm or activation kernel may quantize as it writes.
FEW_ROWS_MAX = 16

SCALE_SUFFIX = ".weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# `--quantization fp8`'s blocks: those of the published Qwen3 FP8 checkpoints.
QUANTIZE_BLOCK_SIZE = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    """The model's block-wise FP8 scheme: weight_block_size (rows, columns) of one scale. Which
    modules a checkpoint quantized is read from its tensors (those with a weight_scale_inv), so
    modules_to_not_convert needs no handling: those weights are plain tensors and load as such.
    from_checkpoint: the checkpoint stores FP8 weights (False: `--quantization fp8` quantizes at load);
    resident: the model keeps them in FP8 (False: dequantized at load, see the module docstring)."""

    block_size: tuple[int, int]
    from_checkpoint: bool = True
    resident: bool = False


def resolve_quantization(
    checkpoint: Fp8Config | None, method: str | None, device_type: str
) -> Fp8Config | None:
    """The scheme the model runs: `method` is `--quantization` (None: the checkpoint's own). An FP8
    checkpoint stays FP8-resident on CUDA and is dequantized at load elsewhere unless method is 'fp8';
    method 'fp8' on an unquantized checkpoint quantizes it at load (QUANTIZE_BLOCK_SIZE blocks)."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={method!r} is not supported; use one of {list(QUANTIZATION_METHODS)} or None (the "
            "checkpoint's own: an FP8 checkpoint runs FP8 weights on CUDA)"
        )
    if checkpoint is not None:
        return Fp8Config(
            checkpoint.block_size, from_checkpoint=True, resident=method == "fp8" or device_type == "cuda"
        )
    if method == "fp8":
        return Fp8Config(QUANTIZE_BLOCK_SIZE, from_checkpoint=False, resident=True)
    return None


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
        raise ValueError(
            f"quantization_config.fmt={fmt!r} is not supported; only 'e4m3' (torch.float8_e4m3fn)"
        )
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={scheme!r} is not supported; only 'dynamic' (no input scales)"
        )
    scale_fmt = raw.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise ValueError(
            f"quantization_config.scale_fmt={scale_fmt!r} is not supported; only 'float' (float32)"
        )
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quantization_config has no weight_block_size: per-tensor FP8 checkpoints are not supported, "
            "only block-wise ones (weight_block_size [rows, columns] with weight_scale_inv tensors)"
        )
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive integers")
    return Fp8Config(block_size=(block[0], block[1]))


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """weight (fp8 [..., n, k], starting on a block boundary) times its blocks' scale_inv
    ([..., ceil(n / bn), ceil(k / bk)]), in float32."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.to(torch.float32) * scale


def quantize_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv [..., ceil(n / bn), ceil(k / bk)]) of a [..., n, k] weight, the
    published layout: each block's scale_inv is its amax / FP8_MAX, so its largest value maps to +-448
    (amax at least 1e-12: an all-zero block stays zero); the division and rounding to e4m3 happen in
    float32. Leading dims (experts) are quantized each on their own."""
    bn, bk = block_size
    *lead, n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.view(*lead, rows, bn, cols, bk).abs().amax(dim=(-3, -1))
    scale = fp8_scale(amax, eps=1e-12)  # the same scales on the CPU and the GPU
    expanded = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    kernels: bool | None = None,
    few_rows: str = "mma",
) -> torch.Tensor:
    """x W^T + b in x's dtype, W an FP8 weight [N, K] with its block scales: kernels/fp8_gemm.py's
    block-scaled GEMM where `kernels` (None: on CUDA tensors; `few_rows` picks its form for up to 16
    rows), else the reference (the weight dequantized per call, float32 math)."""
    if x.is_cuda if kernels is None else kernels:
        # Imported here: triton is needed (and installed) only where CUDA runs.
        from kernels.fp8_gemm import fp8_block_linear as fp8_gemm

        return fp8_gemm(x, weight, scale_inv, block_size=block_size, bias=bias, few_rows=few_rows)
    y = F.linear(
        x.float(), dequantize_blocks(weight, scale_inv, block_size), None if bias is None else bias.float()
    )
    return y.to(x.dtype)


@dataclass(frozen=True)
class Fp8LinearMethod:
    """A linear layer's product with its resident FP8 weight (`layer.weight` float8_e4m3fn,
    `layer.weight_scale_inv` float32), set as the layer's `quant_method` by fp8_weights.py.

    Where the products run the Triton kernels (`kernels`; None: on CUDA tensors), up to 16 rows go through
    kernels/fp8_gemv_mma.py (`few_rows` "mma": the rows group-quantized, FP8 tensor cores) where its tiles
    fit the weight, else kernels/fp8_gemv.py (weight-only). Both take the decoder's RMSNorm before the
    projection (apply_rmsnorm) or the MLP's SiLU-and-mul before down_proj (apply_silu_mul) of a single
    contiguous row in the same launch, as "rows" GEMV tiles do for bf16 weights (layers/linear.py's
    Projection.fuses_prologue)."""

    block_size: tuple[int, int]
    kernels: bool | None = None
    few_rows: str = "mma"

    def runs_kernels(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.kernels is None else self.kernels

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_block_linear(
            x,
            layer.weight,
            layer.weight_scale_inv,
            self.block_size,
            bias,
            self.runs_kernels(x),
            self.few_rows,
        )

    def _mma(self, layer: nn.Module) -> bool:
        from kernels.fp8_gemv_mma import mma_gemv_supported

        return self.few_rows == "mma" and mma_gemv_supported(*layer.weight.shape, self.block_size)

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        """One row (the GEMVs' prologues) or more rows than they take (kernels/fp8_quant.py's norm or
        activation with the group quantization in one launch, then the w8a8 GEMM)."""
        if not self.runs_kernels(x):
            return False
        return one_contiguous_row(x) or (x.dim() == 2 and x.shape[0] > FEW_ROWS_MAX and x.stride(-1) == 1)

    def _gemm(
        self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        from kernels.fp8_gemm import w8a8_block_fp8_matmul

        return w8a8_block_fp8_matmul(
            q, scale, layer.weight, layer.weight_scale_inv, self.block_size, out_dtype=dtype
        )

    def apply_rmsnorm(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) W^T, x + residual) (no bias): one row in one launch; more rows as the
        norm with the rows' group quantization in one launch, then the w8a8 GEMM (the norm's own kernel
        where the row is not whole groups)."""
        from kernels.fp8_gemv import fp8_rmsnorm_gemv
        from kernels.fp8_gemv_mma import fp8_mma_rmsnorm_gemv

        if x.shape[0] > 1:
            if x.shape[1] % self.block_size[1] == 0:
                from kernels.fp8_quant import rmsnorm_group_quant_fp8

                q, scale, residual_out = rmsnorm_group_quant_fp8(
                    x, residual, norm_weight, eps, self.block_size[1]
                )
                return self._gemm(layer, q, scale, x.dtype), residual_out
            from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

            hidden, residual_out = (rmsnorm(x, norm_weight, eps), x) if residual is None else fused_add_rmsnorm(
                x, residual, norm_weight, eps)  # fmt: skip
            return self.apply(layer, hidden, None), residual_out

        product = fp8_mma_rmsnorm_gemv if self._mma(layer) else fp8_rmsnorm_gemv
        return product(x, residual, norm_weight, eps, layer.weight, layer.weight_scale_inv, self.block_size)

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) W^T of rows [gate | up] (no bias): one row in one launch; more rows as the
        activation with the rows' group quantization in one launch, then the w8a8 GEMM."""
        from kernels.fp8_gemv import fp8_silu_mul_gemv
        from kernels.fp8_gemv_mma import fp8_mma_silu_mul_gemv

        if gate_up.shape[0] > 1:
            if gate_up.shape[1] % (2 * self.block_size[1]) == 0:
                from kernels.fp8_quant import silu_mul_group_quant_fp8

                q, scale = silu_mul_group_quant_fp8(gate_up, self.block_size[1])
                return self._gemm(layer, q, scale, gate_up.dtype)
            from kernels.activation import silu_and_mul

            return self.apply(layer, silu_and_mul(gate_up), None)

        product = fp8_mma_silu_mul_gemv if self._mma(layer) else fp8_silu_mul_gemv
        return product(gate_up, layer.weight, layer.weight_scale_inv, self.block_size)


@dataclass(frozen=True)
class Fp8HeadLinearMethod:
    """The product of a fused column-parallel layer whose leading shards are resident FP8 (`weight`,
    `weight_scale_inv`) and whose trailing shards stay in the model's dtype (`weight_tail`; Qwen3.5's
    Gated DeltaNet in_proj: q/k/v/z in FP8, b/a not, as the published FP8 checkpoints store them):
    [x W_fp8^T | x W_tail^T] + b."""

    block_size: tuple[int, int]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        head = fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block_size)
        y = torch.cat([head, F.linear(x, layer.weight_tail.to(x.dtype))], dim=-1)
        return y if bias is None else y + bias


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

    def __init__(
        self, name: str, weight: LoadedWeight, scale_inv: torch.Tensor, block_size: tuple[int, int]
    ) -> None:
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
        """The slice, dequantized to float32."""
        return dequantize_blocks(*self.blocks(index), self.block_size)

    def blocks(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 values, their blocks' scale_inv) of a slice starting on block boundaries."""
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
        if fp8.dtype != FP8_DTYPE:
            raise ValueError(
                f"{self.name!r} has a weight_scale_inv but is stored as {fp8.dtype}, not float8_e4m3fn"
            )
        return fp8, self.scale_inv[r0 // bn : math.ceil(r1 / bn), c0 // bk : math.ceil(c1 / bk)]


def read_scales(files: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """{weight name: its weight_scale_inv} from (name, lazy slice) pairs (the scales are small: one
    float per block)."""
    return {
        name.removesuffix("_scale_inv"): full_weight(w) for name, w in files if name.endswith(SCALE_SUFFIX)
    }


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
