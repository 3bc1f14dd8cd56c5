"""Tensor-parallel linear layers, and how a checkpoint tensor is sliced into a parameter.

Column-parallel layers split the output features across TP ranks and need no communication;
row-parallel layers split the input features and all-reduce the partial sums. A column layer followed
by a row layer (QKV -> o_proj, gate_up -> down) therefore costs one all-reduce.

Every parameter carries `weight_loader(param, loaded_weight, *shard)` (vLLM's convention) that copies
this rank's slice of a checkpoint tensor, so a model's `load_weights` only maps names. A checkpoint
tensor may be a torch tensor or a lazily read safetensors slice: `narrow_weight` reads just the rows or
columns this rank keeps, so no rank materialises a whole sharded matrix.

On the CPU, cpu_prepack.py gives every linear layer (and the LM head) a copy of its weight in oneDNN's
blocked layout, or for float32 on an AVX2 CPU in kernels/cpu/panels.cpp's panels, which batches of two
rows or more multiply with. For single rows the fastest product
depends on the CPU (F.linear's MKL matrix-vector product, the packed weight, or the C++ product of
kernels/cpu_matvec.py for float32 and bfloat16); linear_calibration.py's `calibrate_single_row` times each at load
and keeps the fastest (`set_single_row_product`). The C++ product also takes the norm before a
projection and the activation before the down projection (Projection.fuses_prologue), as the GPU's do.

On CUDA in bfloat16/float16, a single row (batch-1 decode) can go through the Triton matrix-vector
product in kernels/gemv.py instead of cuBLAS, where linear_calibration.py's `select_gemv_tiles` found it
faster on the model's weight shapes (`gemv_tiles`; bench/gpu_gemv.py).

With --enable-deterministic-inference, every product goes through batch_invariant.py's
`invariant_linear` instead (`batch_invariant`, set by its make_batch_invariant).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.runtime.distributed import divide, get_tp_rank, get_tp_size, tp_all_reduce
from services.worker.runtime.layers.batch_invariant import invariant_linear

# Rows from which linear() uses a prepacked weight (1 where calibrate_single_row chose the packed product
# for single rows), and the C++ product (kernels/cpu_matvec.py) where it chose that one.
PREPACKED_MIN_ROWS = 2
_matvec: Callable[..., torch.Tensor] | None = None
# Weight dtypes the C++ single-row product takes (a bfloat16 row is summed in float32, as torch's is).
MATVEC_DTYPES = (torch.float32, torch.bfloat16)


def set_single_row_product(product: str) -> None:
    """How linear() multiplies one row of a prepacked layer: "plain" (F.linear), "packed" (the oneDNN
    weight) or "matvec" (the C++ product, for float32 or bfloat16 weights; raises MatvecUnavailable where it
    is not)."""
    global PREPACKED_MIN_ROWS, _matvec
    if product not in ("plain", "packed", "matvec"):
        raise ValueError(f"single-row product must be 'plain', 'packed' or 'matvec', got {product!r}")
    from kernels.cpu_matvec import load_matvec  # imported where used, as kernels.gemv's products

    _matvec = load_matvec() if product == "matvec" else None
    PREPACKED_MIN_ROWS = 1 if product == "packed" else 2


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    min_rows: int | None = None,
    gemv_tiles: Any = None,
    batch_invariant: bool = False,
    cpu_rows: bool = False,
) -> torch.Tensor:
    """x W^T + b: through the Triton matrix-vector product (with `gemv_tiles`, which select_gemv_tiles
    sets) when x has at most `gemv_tiles.max_rows` rows (1, or 16 for "dot" tiles); for one float32 or
    bfloat16 row of a prepacked layer (or one prepack_cpu_weights marked `cpu_rows`), through the C++
    product where set_single_row_product chose it (min_rows not given);
    through the prepacked weight when there is one and x has at least `min_rows` (default
    PREPACKED_MIN_ROWS) rows. batch_invariant: invariant_linear whatever the rows (deterministic inference)."""
    if batch_invariant:
        return invariant_linear(x, weight, bias, packed)
    if gemv_tiles is not None and x.dim() == 2 and 1 <= x.shape[0] <= gemv_tiles.max_rows:
        y = _gemv(x, weight, tiles=gemv_tiles)
        return y if bias is None else y + bias
    if _matvec is not None and (packed is not None or cpu_rows) and min_rows is None and weight.dtype in MATVEC_DTYPES:
        if x.dim() == 2 and x.shape[0] == 1:
            return _matvec(x, weight, bias)
    if packed is not None and x.dim() == 2 and x.shape[0] >= (min_rows or PREPACKED_MIN_ROWS):
        if not packed.is_mkldnn:  # cpu_prepack.py's 12-column panels
            return torch.ops.radixserve_cpu.panel_linear(x, packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


# kernels.gemv's products once load_gemv_kernels imported them (Triton only where used: CPU installs may lack it).
_gemv: Callable[..., torch.Tensor] | None = None
_rmsnorm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_silu_mul_gemv: Callable[..., torch.Tensor] | None = None


def load_gemv_kernels() -> None:
    """Import kernels/gemv.py's products for the layers that select_gemv_tiles gives tiles."""
    global _gemv, _rmsnorm_gemv, _silu_mul_gemv
    from kernels.gemv import gemv, rmsnorm_gemv, silu_mul_gemv

    _gemv, _rmsnorm_gemv, _silu_mul_gemv = gemv, rmsnorm_gemv, silu_mul_gemv


def one_contiguous_row(x: torch.Tensor) -> bool:
    """Whether x is what the fused-prologue GEMVs take: one contiguous row [1, K]."""
    return x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1


class NormLike(Protocol):
    """What norm_then_linear needs of an RMSNorm module."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any: ...


def norm_then_linear(
    norm: NormLike, layer: Projection, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual), the pre-norm decoder's step into a projection; without
    a residual the norm is of x and x is the residual. Where layer.fuses_prologue(x) (one row, "rows" GEMV
    tiles or an FP8 weight on the GPU) one launch instead of a norm kernel and a product."""
    if layer.fuses_prologue(x):
        y, residual = layer.rmsnorm_product(x, residual, norm.weight, norm.eps)
        return (y if layer.bias is None else y + layer.bias), residual
    if residual is None:
        return layer(norm(x)), x
    hidden, residual = norm(x, residual)
    return layer(hidden), residual


class WeightSlice(Protocol):
    """What safetensors' `safe_open(...).get_slice(name)` returns: a shape and slice indexing."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


LoadedWeight = torch.Tensor | WeightSlice


def weight_shape(weight: LoadedWeight) -> tuple[int, ...]:
    if isinstance(weight, torch.Tensor):
        return tuple(weight.shape)
    return tuple(weight.get_shape())


def narrow_weight(weight: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """weight[..., start:start+length, ...] along dim, reading only that part of a lazy slice."""
    index = (slice(None),) * dim + (slice(start, start + length),)
    return weight[index]


def full_weight(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]


def check_weight_shape(weight: LoadedWeight, expected: tuple[int, ...], what: str) -> None:
    shape = weight_shape(weight)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor for {what} has shape {list(shape)}, expected {list(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
    """Copy a whole (replicated) tensor, casting to the parameter's dtype."""
    check_weight_shape(loaded_weight, tuple(param.shape), "a replicated parameter")
    param.data.copy_(full_weight(loaded_weight))


def new_parameter(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    """An uninitialised inference parameter (dtype/device from the ambient defaults) with its loader."""
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearMethod(Protocol):
    """How a quantized layer multiplies (SGLang's quant_method): x W^T + b from the layer's own
    parameters (layers/fp8.py's Fp8LinearMethod: an FP8 weight and its block scales), and the products
    with a fused prologue where its kernels have them (Projection.fuses_prologue)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def fuses_prologue(self, x: torch.Tensor) -> bool: ...

    def apply_rmsnorm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor: ...


class Projection(nn.Module):
    """What every linear layer below carries besides its weight: the CPU prepacked copy
    (prepack_cpu_weights), the batch-1 GEMV tiles (select_gemv_tiles, None: cuBLAS), `prologue`,
    the elementwise step the model runs right before this product at batch 1 ("rmsnorm",
    "silu_and_mul"), which "rows" GEMV tiles fold in (set by the model, read by select_gemv_tiles),
    and `quant_method` once layers/fp8_weights.py made the weight FP8 (with a `weight_scale_inv`
    parameter beside it; None: the weight is in the model's dtype)."""

    prepackable = True
    packed_weight: torch.Tensor | None = None
    cpu_rows = False  # prepack_cpu_weights: single rows may take the C++ product (float32 / bfloat16, CPU)
    gemv_tiles: Any = None
    prologue: str | None = None
    quant_method: LinearMethod | None = None
    batch_invariant = False  # make_batch_invariant (deterministic inference) sets it
    weight: torch.Tensor

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias through the quant_method, or `linear` with this layer's packed weight, GEMV
        tiles and mode."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(
            x,
            self.weight,
            bias,
            self.packed_weight,
            gemv_tiles=self.gemv_tiles,
            batch_invariant=self.batch_invariant,
            cpu_rows=self.cpu_rows,
        )

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        """Whether x goes through one launch with the norm or activation before this product folded in
        (rmsnorm_product, silu_mul_product): with "rows" GEMV tiles, or as the quant_method decides, or
        on the CPU where single rows of this float32 or bfloat16 layer go through the C++ product
        (cpu_single_row)."""
        if self.quant_method is not None:
            return self.quant_method.fuses_prologue(x)
        return (getattr(self.gemv_tiles, "kind", None) == "rows" or self.cpu_single_row(x)) and one_contiguous_row(x)

    def cpu_single_row(self, x: torch.Tensor) -> bool:
        """Whether one row x goes through the C++ product (linear() with _matvec set, not batch-invariant)."""
        if _matvec is None or (self.packed_weight is None and not self.cpu_rows) or self.batch_invariant:
            return False
        return self.weight.dtype == x.dtype and x.dtype in MATVEC_DTYPES

    def cpu_packed_rows(self, x: torch.Tensor) -> bool:
        """Whether the rows of float32 or bfloat16 x [M, K] go through this layer's packed weight of x's dtype
        (linear() with M >= PREPACKED_MIN_ROWS, no GEMV tiles, not batch-invariant): what
        kernels/cpu/layer_row.cpp's batch op calls in its place."""
        if self.packed_weight is None or self.gemv_tiles is not None or self.batch_invariant:
            return False
        if x.dim() != 2 or x.shape[0] < PREPACKED_MIN_ROWS or self.weight.dtype != x.dtype:
            return False
        return x.dtype in (torch.float32, torch.bfloat16)

    def rmsnorm_product(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) W^T without the bias, x + residual), where fuses_prologue(x)."""
        if self.quant_method is not None:
            return self.quant_method.apply_rmsnorm(self, x, residual, norm_weight, eps)
        if self.gemv_tiles is None:  # the CPU's C++ product (cpu_single_row)
            return torch.ops.radixserve_cpu.rmsnorm_matvec(x, residual, norm_weight, eps, self.weight)
        return _rmsnorm_gemv(x, residual, norm_weight, eps, self.weight, tiles=self.gemv_tiles)

    def silu_mul_product(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) W^T without the bias nor the all-reduce, where fuses_prologue(gate_up)."""
        if self.quant_method is not None:
            return self.quant_method.apply_silu_mul(self, gate_up)
        if self.gemv_tiles is None:  # the CPU's C++ product (cpu_single_row)
            return torch.ops.radixserve_cpu.silu_mul_matvec(gate_up, self.weight)
        return _silu_mul_gemv(gate_up, self.weight, tiles=self.gemv_tiles)


class ReplicatedLinear(Projection):
    """A linear layer every rank holds whole (MoE router, small heads)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_parameter((output_size, input_size), default_weight_loader)
        self.bias = new_parameter((output_size,), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class ColumnParallelLinear(Projection):
    """y = x W^T with W's rows (output features) split across ranks; each rank returns its slice of y.

    `output_sizes` lists the logical matrices fused into this one (e.g. [gate, up]); each is split
    across ranks separately, so rank r holds [gate_r; up_r] and a shard id selects which one a
    checkpoint tensor fills.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(size, self.tp_size) for size in self.output_sizes]
        out = sum(self.local_sizes)
        self.weight = new_parameter((out, input_size), self.weight_loader)
        self.bias = new_parameter((out,), self.weight_loader) if bias else None

    def shard_range(self, shard_id: int | str | None) -> tuple[int, int, int, int]:
        """(offset in the local parameter, rows, first row in the checkpoint tensor, checkpoint rows)."""
        index = 0 if shard_id is None else int(shard_id)
        offset = sum(self.local_sizes[:index])
        rows = self.local_sizes[index]
        return offset, rows, self.tp_rank * rows, self.output_sizes[index]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: int | str | None = None
    ) -> None:
        offset, rows, start, total = self.shard_range(shard_id)
        expected = (total,) + tuple(param.shape[1:])
        check_weight_shape(loaded_weight, expected, f"{type(self).__name__} shard {shard_id}")
        param.data.narrow(0, offset, rows).copy_(narrow_weight(loaded_weight, 0, start, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices sharing one input, fused (gate_proj + up_proj -> gate_up_proj).
    Shard ids are the positions in `output_sizes`."""


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with attention heads split across ranks (shard ids 'q', 'k', 'v').

    When there are more ranks than KV heads, each rank keeps one KV head (replicated over
    tp_size / num_kv_heads ranks): the one its query heads attend with.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_size()
        if total_num_kv_heads >= tp_size and total_num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={total_num_kv_heads} is not divisible by tp_size={tp_size}")
        if total_num_kv_heads < tp_size and tp_size % total_num_kv_heads:
            raise ValueError(f"tp_size={tp_size} is not a multiple of num_key_value_heads={total_num_kv_heads}")
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.total_num_kv_heads = total_num_kv_heads
        q_size = total_num_heads * head_dim
        # The checkpoint KV matrices are smaller than num_kv_heads * tp_size when replicated; the
        # base class only uses output_sizes for the local split, and shard_range handles k and v.
        kv_local = self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_local * tp_size, kv_local * tp_size], bias)

    def shard_range(self, shard_id: int | str | None) -> tuple[int, int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[str(shard_id)]
        if index == 0:
            return super().shard_range(0)
        rows = self.num_kv_heads * self.head_dim
        offset = self.local_sizes[0] + (index - 1) * rows
        # Rank r serves query heads whose KV head is r * total_kv // tp (integer division covers
        # both the split and the replicated case).
        kv_head = self.tp_rank * self.total_num_kv_heads // self.tp_size
        return offset, rows, kv_head * self.head_dim, self.total_num_kv_heads * self.head_dim


class RowParallelLinear(Projection):
    """y = x W^T with W's columns (input features) split across ranks; the input arrives already split
    (from a column-parallel layer), partial sums are all-reduced, and the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.weight = new_parameter((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = new_parameter((output_size,), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
        check_weight_shape(loaded_weight, (param.shape[0], self.input_size), type(self).__name__)
        cols = self.input_size_per_partition
        param.data.copy_(narrow_weight(loaded_weight, 1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.product(x, self.bias)
        y = tp_all_reduce(self.product(x, None))
        return y if self.bias is None else y + self.bias

    def forward_silu_and_mul(self, gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """self(act(gate_up)) where act is SiLU-and-mul over [gate | up]: a single row with "rows" GEMV
        tiles or an FP8 weight on the GPU forms the activation inside the product (silu_mul_product)."""
        if not self.fuses_prologue(gate_up):
            return self(act(gate_up))
        y = self.silu_mul_product(gate_up)
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias
