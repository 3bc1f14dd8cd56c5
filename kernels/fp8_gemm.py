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

from dataclasses import dataclass

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
    """One w8a8 GEMM launch shape (block_k is capped at the largest power of two dividing bk)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# fp8_block_linear's forms for few rows: FP8 tensor cores on group-quantized rows, or weight-only.
FEW_ROWS_FORMS = ("mma", "weight-only")


def fp8_tiles_for(m: int) -> Fp8Tiles:
    """Short M: narrow tiles, so there are enough programs to stream the weight; longer M: 64 x 128 with
    four warps. 128 x 128 with eight warps for M > 1,024 was 1.27-1.42x slower at M = 4,096 on the Qwen3-8B
    shapes on the H200 (2026-12-03) and the H100 (2026-12-06): bench/gpu_fp8.py's sweep picked 64 x 128 for
    every shape on both."""
    if m <= 32:  # 17-32 rows (an H100, 2026-12-06): 118 vs 159 us for the 8B layer's four products at M = 32
        return Fp8Tiles(block_m=16, block_n=64, group_m=1, num_stages=4)
    if m <= 128:
        return Fp8Tiles(block_m=64, block_n=64, num_stages=4)
    return Fp8Tiles()


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
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks walk N together, so a weight tile is reused from L2 while it is there.
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge read row / column 0 instead of masking every load; never stored.
    safe_m = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    safe_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + safe_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + safe_n[None, :] * stride_wn + offs_k[:, None]
    a_scale_ptrs = A_scale + safe_m * stride_asm
    w_scale_ptrs = W_scale + (safe_n // group_n) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        a_s = tl.load(a_scale_ptrs + k0 // GROUP_K)
        # The tile's columns within one weight block (BLOCK_N divides bn): one scale per row and one multiply
        # per element instead of two (an H100, bench/gpu_fp8.py --quick: 4-15 % faster at M = 256 and 4,096,
        # 1,245 -> 1,057-1,072 us for the 8B gate_up at M = 4,096, level with bf16's 1,057-1,059).
        if W_SCALE_PER_TILE:
            w_s = tl.load(W_scale + ((pid_n * BLOCK_N) // group_n) * stride_wsn + k0 // GROUP_K)
            acc += tl.dot(a, w) * (a_s * w_s)[:, None]
        else:
            w_s = tl.load(w_scale_ptrs + k0 // GROUP_K)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(
        C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=(offs_m < M)[:, None] & (offs_n < N)[None, :],
    )


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
    tiles = tiles or fp8_tiles_for(m)
    block_k = pow2_divisor(bk, tiles.block_k)
    if block_k < 16:
        raise ValueError(f"block_size[1] = {bk} must be a multiple of 16 for the fp8 tensor-core product")
    a_q = a_q if a_q.stride(1) == 1 else a_q.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _w8a8_kernel[grid](
        a_q,
        a_scale,
        w_q,
        w_scale_inv,
        out,
        m,
        n,
        k,
        a_q.stride(0),
        a_scale.stride(0),
        w_q.stride(0),
        w_scale_inv.stride(0),
        out.stride(0),
        bn,
        GROUP_K=bk,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        GROUP_M=tiles.group_m,
        EVEN_K=k % block_k == 0,
        W_SCALE_PER_TILE=bn % tiles.block_n == 0,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
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
