"""Block-wise FP8 linear layers: weights in float8_e4m3fn with one float32 scale per [bn, bk] block.

Two ways to multiply, chosen by the number of rows (fp8_block_linear):

- Few rows (batch-1 / small-batch decode, <= GEMV_MAX_ROWS), bound by the weight's bytes: with
  few_rows="mma" (the default) `fp8_mma_gemv` (kernels/fp8_gemv_mma.py), the rows quantized per group
  as below inside the kernel and multiplied on the FP8 tensor cores; with "weight-only", or where its
  tiles do not fit the weight, `fp8_block_gemv` (kernels/fp8_gemv.py), the fp8 weight dequantized in
  registers and the rows left unrounded.
- Many rows (prefill, large batches): per-token-group activation quantization (`per_token_group_quant_fp8`,
  groups of bk features, scale = amax / 448) and `w8a8_block_fp8_matmul`, an fp8 x fp8 tensor-core GEMM.
  Each BLOCK_K step's product starts from zero and is added to the float32 accumulator times
  a_scale[row] * w_scale[col]: the block scales are applied per step, and the tensor cores' reduced
  accumulation precision for fp8 never spans more than one block.

The torch references and the scheme's constants are in kernels/fp8_reference.py.
Tiles are fixed per shape class (no autotuning); bench/gpu_fp8.py sweeps alternatives on the GPU.

The activation quantizer lives in kernels/fp8_quant.py (re-exported here), beside the e4m3 rounding it
shares with kernels/fp8_gemv_mma.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_block_gemv, pow2_divisor
from kernels.fp8_gemv_mma import fp8_mma_gemv, mma_gemv_supported
from kernels.fp8_quant import per_token_group_quant_fp8
from kernels.fp8_reference import (
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    check_block_weight,
    fp8_block_linear_reference,
)

__all__ = [
    "FP8_MAX",
    "GEMV_MAX_ROWS",
    "Fp8Tiles",
    "fp8_block_gemv",
    "fp8_block_linear",
    "fp8_block_linear_reference",
    "per_token_group_quant_fp8",
    "w8a8_block_fp8_matmul",
]


@dataclass(frozen=True)
class Fp8Tiles:
    """One w8a8 GEMM launch shape (block_k is capped at the largest power of two dividing bk; split_k > 1
    cuts K into that many parts, their float32 partials added in order by a second launch)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# fp8_block_linear's forms for few rows: FP8 tensor cores on group-quantized rows, or weight-only.
FEW_ROWS_FORMS = ("mma", "weight-only")


def fp8_tiles_for(m: int, n: int | None = None, num_sms: int = 132) -> Fp8Tiles:
    """Short M: narrow tiles, so there are enough programs to stream the weight; longer M: 64 x 128 with
    four warps. 128 x 128 with eight warps for M > 1,024 was 1.27-1.42x slower at M = 4,096 on the Qwen3-8B
    shapes on the H200 (2026-12-03) and the H100 (2026-12-06): bench/gpu_fp8.py's sweep picked 64 x 128 for
    every shape on both.

    Given the weight's rows `n` and the GPU's SM count, 33-256 rows (bench/gpu_fp8_rows.py on an H100,
    2026-12-06, the 8B layer's four products): 64 x 64 tiles up to 128 rows, and up to 256 where 64 x 128
    would leave fewer than two programs per SM (at 192 rows o 18.7 vs 23.3 us, down 50.3 vs 60.3); K split
    in two where 64 x 64 still leaves fewer than one (down at 96 rows 35.7 vs 42.9 us, o 16.1 vs 17.2)."""
    if m <= 32:  # 17-32 rows (an H100, 2026-12-06): 118 vs 159 us for the 8B layer's four products at M = 32
        return Fp8Tiles(block_m=16, block_n=64, group_m=1, num_stages=4)
    wide, narrow = Fp8Tiles(), Fp8Tiles(block_m=64, block_n=64, num_stages=4)
    if n is None:
        return narrow if m <= 128 else wide

    def programs(t: Fp8Tiles) -> int:
        return triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)

    if m <= 128 or (m <= 256 and programs(wide) < 2 * num_sms):
        return narrow if programs(narrow) >= num_sms else replace(narrow, split_k=2)
    return wide


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's SM count (132 where it has none: the CPU interpreter)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


@triton.jit
def _w8a8_kernel(
    A,
    A_scale,
    W,
    W_scale,
    C,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_cm,
    group_n,
    steps_per_split,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """C = dequant(A) @ dequant(W)^T, A fp8 with group scales A_scale. SPLIT_K > 1: program (tile, s) sums K steps
    [s * steps_per_split, (s + 1) * steps_per_split) and stores float32 partials at C + s * M * N, which
    _split_k_sum_kernel adds in split order."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks walk N together, so a weight tile is reused from L2 while it is there.
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M are masked: reading row 0 for them instead (as columns past N still read column 0) sent
    # every program's padding rows to the same few lines of A, and a tile with padding rows ran 1.4-2x
    # slower than a full one (an H100, bench/gpu_fp8_rows.py: the 8B gate_up at 96 rows 88 us, at 128 57).
    m_mask = offs_m < M
    safe_m = offs_m.to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_first = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_first + steps_per_split * BLOCK_K)
    offs_k = k_first + tl.arange(0, BLOCK_K)
    a_ptrs = A + safe_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + safe_n[None, :] * stride_wn + offs_k[:, None]
    a_scale_ptrs = A_scale + safe_m * stride_asm
    w_scale_ptrs = W_scale + (safe_n // group_n) * stride_wsn
    w_tile_scale_ptr = W_scale + ((pid_n * BLOCK_N) // group_n) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - (k0 - k_first)
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        # The tile's columns within one weight block (BLOCK_N divides bn): one scale per row and one multiply
        # per element instead of two (an H100, bench/gpu_fp8.py --quick: 4-15 % faster at M = 256 and 4,096,
        # 1,245 -> 1,057-1,072 us for the 8B gate_up at M = 4,096, level with bf16's 1,057-1,059).
        a_s = tl.load(a_scale_ptrs + k0 // GROUP_K, mask=m_mask, other=0.0)
        if W_SCALE_PER_TILE:
            w_s = tl.load(w_tile_scale_ptr + k0 // GROUP_K)
            acc += tl.dot(a, w) * (a_s * w_s)[:, None]
        else:
            w_s = tl.load(w_scale_ptrs + k0 // GROUP_K)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:
        tl.store(c_ptrs + split.to(tl.int64) * M * N, acc, mask=c_mask)
    else:
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit
def _split_k_sum_kernel(P, C, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """C[i] = sum over s of P[s * numel + i], added in split order (float32), stored in C's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + s * numel + offs, mask=mask, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


def w8a8_block_fp8_matmul(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: Fp8Tiles | None = None,
) -> torch.Tensor:
    """a_q [M, K] fp8 with a_scale [M, ceil(K/bk)]; w_q [N, K] fp8 with w_scale_inv [ceil(N/bn), ceil(K/bk)];
    returns (a_q*a_scale) @ (w_q*w_scale_inv)^T in out_dtype, f32 accumulation. Requires group_size == bk."""
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    bn, bk = block_size
    if a_q.dtype != FP8_DTYPE or a_q.dim() != 2 or a_q.shape[1] != k:
        raise ValueError(f"a_q must be float8_e4m3fn [M, {k}], got {tuple(a_q.shape)} {a_q.dtype}")
    m = a_q.shape[0]
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (m, triton.cdiv(k, bk)):
        raise ValueError(
            f"a_scale must be float32 [{m}, {triton.cdiv(k, bk)}] (activation groups of "
            f"block_size[1] = {bk} features), got {list(a_scale.shape)} {a_scale.dtype}"
        )
    if out_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    tiles = tiles or fp8_tiles_for(m, n, sm_count(a_q.device))
    block_k = pow2_divisor(bk, tiles.block_k)
    if block_k < 16:
        raise ValueError(f"block_size[1] = {bk} must be a multiple of 16 for the fp8 tensor-core product")
    a_q = a_q if a_q.stride(1) == 1 else a_q.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(tiles.split_k, steps))
    steps_per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, steps_per_split)  # no empty split
    dest = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=a_q.device)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), split_k)
    _w8a8_kernel[grid](
        a_q,
        a_scale,
        w_q,
        w_scale_inv,
        dest,
        m,
        n,
        k,
        a_q.stride(0),
        a_scale.stride(0),
        w_q.stride(0),
        w_scale_inv.stride(0),
        n,
        bn,
        steps_per_split,
        GROUP_K=bk,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        GROUP_M=tiles.group_m,
        EVEN_K=k % block_k == 0,
        W_SCALE_PER_TILE=bn % tiles.block_n == 0,
        SPLIT_K=split_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split_k > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](dest, out, m * n, SPLIT_K=split_k, BLOCK=block)
    return out


def fp8_block_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    few_rows: str = "mma",
) -> torch.Tensor:
    """What the layers call: x [..., K] -> [..., N] in x.dtype; few rows -> fp8_mma_gemv or fp8_block_gemv
    (`few_rows`: "mma" or "weight-only"), else per_token_group_quant_fp8 + w8a8_block_fp8_matmul."""
    if few_rows not in FEW_ROWS_FORMS:
        raise ValueError(f"few_rows must be one of {FEW_ROWS_FORMS}, got {few_rows!r}")
    n, k = check_block_weight(w_q, w_scale_inv, block_size)
    if x.dim() < 1 or x.shape[-1] != k or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16/float16/float32 [..., {k}], got {tuple(x.shape)} {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        out = torch.empty((0, n), dtype=x.dtype, device=x.device)
    elif m <= GEMV_MAX_ROWS and few_rows == "mma" and mma_gemv_supported(n, k, block_size):
        out = fp8_mma_gemv(x2, w_q, w_scale_inv, block_size)
    elif m <= GEMV_MAX_ROWS:
        out = fp8_block_gemv(x2, w_q, w_scale_inv, block_size)
    else:
        a_q, a_scale = per_token_group_quant_fp8(x2, block_size[1])
        out = w8a8_block_fp8_matmul(a_q, a_scale, w_q, w_scale_inv, block_size, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*x.shape[:-1], n)
