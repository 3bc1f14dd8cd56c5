"""Batch-invariant products for --enable-deterministic-inference: a row's result never depends on the rows
beside it, so a request's tokens are the same alone, in any batch, chunked or not.

Why the usual products are not: cuBLAS, oneDNN and MKL pick tiles, kernels and K splits from the number
of rows M, so one row is summed in another order alone than among 63 others, and the rounding differences
grow into different tokens (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

On CUDA, `invariant_linear` is kernels/batch_invariant.py's Triton product with one launch shape. On the
CPU the rows go through the ordinary product CPU_ROW_BLOCK at a time (the last block zero-padded), so
every call has the same shape, and a row of a fixed-shape oneDNN / MKL product comes out the same
wherever it sits in the block and whatever the other rows hold (tests/kernels/test_batch_invariant.py
checks that on the machine running the tests; a BLAS that broke it would fail there, not silently).
Weights packed into kernels/cpu/panels.cpp's panels need no blocks: each output there is one chain of
multiply-adds over k in order whatever the rows, so panel_linear takes all the rows at once.

Elementwise transcendental functions on the CPU have the same problem in miniature: torch's vectorized
loop computes the elements past the last whole group of vectors (and past a thread's share) with the
scalar function, which differs from the vectorized one in the last bit for SiLU (sigmoid) and exp2, so
an element's value depends on where the tensor's end and the threads' boundaries fall. `elementwise`
applies such a function to flat chunks of ELEMENTWISE_CHUNK elements, each below torch's parallel grain
and a whole number of vectors, so every element goes through the vectorized function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Rows per CPU product call in batch-invariant mode: every call multiplies exactly this many (16 is also
# the rows_hint the prepacked weights are laid out for).
CPU_ROW_BLOCK = 16


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T + b with each row's result independent of the other rows of x (see the module notes)."""
    if x.is_cuda:
        from kernels.batch_invariant import matmul

        return matmul(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if packed is not None and not packed.is_mkldnn:  # cpu_prepack.py's panels: invariant by construction
        return torch.ops.radixserve_cpu.panel_linear(rows, packed, bias).view(*lead, weight.shape[0])
    m = rows.shape[0]
    padded = -(-m // CPU_ROW_BLOCK) * CPU_ROW_BLOCK
    if padded != m or not rows.is_contiguous():
        rows = torch.cat([rows, rows.new_zeros((padded - m, k))]) if padded != m else rows.contiguous()
    out = torch.empty((padded, weight.shape[0]), dtype=x.dtype, device=x.device)
    for start in range(0, padded, CPU_ROW_BLOCK):
        block = rows[start : start + CPU_ROW_BLOCK]
        if packed is not None:
            out[start : start + CPU_ROW_BLOCK] = torch.ops.mkldnn._linear_pointwise(
                block, packed, None, "none", [], ""
            )
        else:
            torch.mm(block, weight.t(), out=out[start : start + CPU_ROW_BLOCK])
    y = out[:m]
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


# Elements per call of `elementwise`: a multiple of every vector width (16 floats on AVX-512, 2 vectors per
# step) and below torch's parallel grain (32768), so each call runs on one thread, fully vectorized.
ELEMENTWISE_CHUNK = 8192


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element computed the same way wherever it sits (module notes).
    On CUDA fn(x) as it is: a GPU kernel runs the same code for every element."""
    if x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = -(-n // ELEMENTWISE_CHUNK) * ELEMENTWISE_CHUNK
    source = torch.cat([flat, flat.new_zeros(padded - n)]) if padded != n else flat.contiguous()
    out = torch.empty_like(source)
    for start in range(0, padded, ELEMENTWISE_CHUNK):
        out[start : start + ELEMENTWISE_CHUNK] = fn(source[start : start + ELEMENTWISE_CHUNK])
    return out[:n].view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [.., gate | up], with the SiLU through `elementwise`."""
    gate, up = x.chunk(2, dim=-1)
    return elementwise(F.silu, gate) * up


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every module of `model` with a `batch_invariant` attribute (linear layers, the LM head, MoE
    experts, the gated activation) to its batch-invariant form, and drop their batch-1 GEMV tiles;
    returns how many modules it switched."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
            if hasattr(module, "gemv_tiles"):
                module.gemv_tiles = None
            switched += 1
    return switched
