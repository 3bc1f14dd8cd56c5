"""Torch references for the block-wise FP8 kernels (kernels/fp8_gemm.py, kernels/fused_moe.py's FP8 form).

The scheme is the one published FP8 checkpoints use (Qwen3-FP8, DeepSeek-V3): a weight [N, K] in
float8_e4m3fn with one float32 `scale_inv` per [bn, bk] block (edge blocks partial), so the real weight
is w_q * scale_inv; activations are quantized on the fly in groups of bk features per row, scale =
amax / 448. Everything here computes in float32 on the plain dequantized tensors: slow, obviously right.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Floor of a group's amax, so an all-zero group gets a finite scale (and quantizes to zeros).
FP8_EPS = 1e-10
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_scale(amax: torch.Tensor, eps: float = FP8_EPS) -> torch.Tensor:
    """max(amax, eps) / 448 in float32, correctly rounded on every device. On CUDA, torch divides a tensor
    by a Python number as a product with its rounded reciprocal (1/448 is not a float32), which lands one
    ulp away from the quotient for ~60 % of bfloat16 amaxes; then x / scale misses the exact ties between
    two e4m3 values that bfloat16 rows hit often (x / scale = 184.0 between 176 and 192), and ~0.1 % of
    the codes move a whole e4m3 step. The kernels divide with div_rn; a tensor divisor makes torch's
    division a true one too (an H100, 2026-12-06: 0.12-0.24 % of the codes differed before, none after)."""
    amax = amax.float().clamp(min=eps)
    return amax / torch.full_like(amax, FP8_MAX)


def check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    """(bn, bk), or a ValueError saying what block_size must be."""
    if len(block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in block_size):
        raise ValueError(f"block_size must be two positive integers (bn, bk), got {block_size!r}")
    return block_size[0], block_size[1]


def check_block_weight(
    w_q: torch.Tensor, w_scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> tuple[int, int]:
    """(N, K) of a block-scaled fp8 weight [N, K] whose scales are float32 [ceil(N/bn), ceil(K/bk)];
    a ValueError for anything else."""
    if w_q.dtype != FP8_DTYPE or w_q.dim() != 2 or w_q.stride(1) != 1:
        raise ValueError(
            f"w_q must be a 2-D float8_e4m3fn tensor with contiguous rows, got "
            f"{tuple(w_q.shape)} {w_q.dtype} strides {w_q.stride()}"
        )
    bn, bk = check_block_size(block_size)
    n, k = w_q.shape
    expected = (-(-n // bn), -(-k // bk))
    if w_scale_inv.dtype != torch.float32 or tuple(w_scale_inv.shape) != expected:
        raise ValueError(
            f"w_scale_inv must be float32 of shape {list(expected)} for a {[n, k]} weight in "
            f"{list(block_size)} blocks, got {list(w_scale_inv.shape)} {w_scale_inv.dtype}"
        )
    return n, k


def dequantize_block_weight(
    w_q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """w_q [..., N, K] times its blocks' scale_inv [..., ceil(N/bn), ceil(K/bk)], in float32."""
    bn, bk = block_size
    n, k = w_q.shape[-2:]
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w_q.float() * scale


def per_token_group_quant_fp8_reference(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) as per_token_group_quant_fp8 gives them: q = clamp(x / scale, ±448) rounded to e4m3."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.zeros((m, groups * group_size), dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group_size).abs().amax(dim=-1)
    scale = fp8_scale(amax)
    q = (padded.view(m, groups, group_size) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(m, -1)[:, :k].to(FP8_DTYPE), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [M, K] times its per-row group scales [M, ceil(K/group_size)], in float32."""
    return q.float() * scale.repeat_interleave(group_size, dim=1)[:, : q.shape[1]]


def w8a8_block_fp8_matmul_reference(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
) -> torch.Tensor:
    """(a_q * a_scale) @ (w_q * w_scale_inv)^T in float32."""
    a = dequantize_groups(a_q, a_scale, block_size[1])
    return a @ dequantize_block_weight(w_q, w_scale_inv, block_size).t()


def fp8_block_linear_reference(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequantized(w)^T (+ bias) computed in float32, cast to x's dtype."""
    y = x.float() @ dequantize_block_weight(w_q, w_scale_inv, block_size).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_moe_fp8_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fp8_activations: bool,
) -> torch.Tensor:
    """The FP8 fused MoE in float32, expert by expert (result [T, H] float32).

    fp8_activations: the inputs of both expert GEMMs go through per-token-group quantization first, as
    the kernel's w8a8 form does; the intermediate is rounded to hidden's dtype before that, as the kernel
    stores it. Without it only the weights are quantized (the weight-only form)."""
    bk = block_size[1]

    def activations(a: torch.Tensor) -> torch.Tensor:
        if not fp8_activations:
            return a.float()
        q, scale = per_token_group_quant_fp8_reference(a, bk)
        return dequantize_groups(q, scale, bk)

    w13f = dequantize_block_weight(w13, w13_scale_inv, block_size)
    w2f = dequantize_block_weight(w2, w2_scale_inv, block_size)
    x = activations(hidden)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w13.shape[1] // 2
    for e in torch.unique(topk_ids).tolist():
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = x[tokens] @ w13f[e].t()
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype)
        contrib = (activations(act) @ w2f[e].t()) * topk_weights[tokens, slot].float()[:, None]
        out.index_add_(0, tokens, contrib)
    return out


def quantize_block_weight(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] -> (float8_e4m3fn weight, float32 scale_inv [..., ceil(N/bn), ceil(K/bk)]),
    each block scaled so its amax maps to 448 (how FP8 checkpoints are made; tests and benches use it)."""
    bn, bk = block_size
    n, k = w.shape[-2:]
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros((*w.shape[:-2], rows * bn, cols * bk), dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn))  # [..., rows, bn, cols, bk]
    scale = fp8_scale(blocks.abs().amax(dim=(-3, -1)))  # [..., rows, cols]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.to(FP8_DTYPE), scale
