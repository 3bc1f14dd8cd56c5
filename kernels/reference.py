"""Plain-torch references for every kernel in this package, computed in float32.

Each function states the contract its kernel must meet; tests (under TRITON_INTERPRET=1) and
bench/gpu_kernels.py compare the kernels against these. They favour obviousness over speed: loops
over requests, explicit gathers through req_to_token, float32 math. Results are float32.
"""

from __future__ import annotations

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def pool_values_ref(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a pool of `dtype` stores it: a float8 pool holds x / scale clipped to the type's finite
    range, rounded to nearest even (x times 1 / scale in float32, as the kernels compute it); any other
    pool the plain cast."""
    if dtype not in _FP8:
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-top, top).to(dtype)


def dequantize_ref(stored: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Stored pool values as the float32 keys or values they stand for."""
    return stored.float() * scale


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """q [m, h, d], k/v [n, kvh, d], mask [m, n] (True = attend) -> [m, h, d], float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [bs, heads * d] (one token per request); the pool buffers are [slots, kv_heads, d] (keys and
    values: the stored ones times k_scale / v_scale). Request i attends to positions 0 .. seq_lens[i]-1
    read through req_to_token. Returns [bs, heads * d]."""
    head_dim = k_buffer.shape[2]
    q3 = q.reshape(q.shape[0], -1, head_dim)
    out = torch.empty(q3.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        slots = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        k, v = dequantize_ref(k_buffer[slots], k_scale), dequantize_ref(v_buffer[slots], v_scale)
        out[i] = _attend(q3[i : i + 1], k, v, None, sm_scale)[0]
    return out.reshape(q.shape[0], -1)


def extend_attention_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [tokens, heads * d]; k_new/v_new [tokens, kv_heads * d] are the new tokens' K/V, requests
    concatenated in order. Request i's new tokens sit at positions prefix_lens[i] + j and attend to the
    cached prefix (positions 0 .. prefix_lens[i]-1, read from the pool) and causally to new tokens <= j.
    A float8 pool: every key and value, the new tokens' too, is as the pool stores it, times its scale."""
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    out = torch.empty((q.shape[0], q.shape[1] // head_dim, head_dim), dtype=torch.float32, device=q.device)
    start = 0
    for i, (prefix, ext) in enumerate(zip(prefix_lens, extend_lens)):
        rows = slice(start, start + ext)
        slots = req_to_token[int(req_pool_indices[i]), :prefix].long()
        k_rows = k_new[rows].reshape(ext, num_kv_heads, head_dim)
        v_rows = v_new[rows].reshape(ext, num_kv_heads, head_dim)
        if k_buffer.dtype in _FP8:
            k_rows = dequantize_ref(pool_values_ref(k_rows, k_buffer.dtype, k_scale), k_scale)
            v_rows = dequantize_ref(pool_values_ref(v_rows, v_buffer.dtype, v_scale), v_scale)
        k = torch.cat((dequantize_ref(k_buffer[slots], k_scale), k_rows.float()))
        v = torch.cat((dequantize_ref(v_buffer[slots], v_scale), v_rows.float()))
        # Query j (position prefix + j) sees key positions 0 .. prefix + j.
        mask = torch.arange(prefix + ext)[None, :] <= (prefix + torch.arange(ext))[:, None]
        out[rows] = _attend(q[rows].reshape(ext, -1, head_dim), k, v, mask.to(q.device), sm_scale)
        start += ext
    return out.reshape(q.shape[0], -1)


def kv_store_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k, v ([n, kv_heads * d]) into the pool rows `loc`, in place (pool_values_ref)."""
    k_buffer[loc.long()] = pool_values_ref(k.reshape(-1, *k_buffer.shape[1:]), k_buffer.dtype, k_scale)
    v_buffer[loc.long()] = pool_values_ref(v.reshape(-1, *v_buffer.shape[1:]), v_buffer.dtype, v_scale)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual)."""
    total = x.float() + residual.float()
    return rmsnorm_ref(total, weight, eps), total


def qk_norm_rope_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused attention prologue on q [tokens, heads * head_dim] and k [tokens, kv_heads * head_dim]:
    RMSNorm over each head of q and k with q_weight / k_weight [head_dim] (both None, the default: no
    norm, the rotation alone), then neox-style rotary. The norm rounds where Hugging Face's Qwen3RMSNorm
    does: x * rsqrt(mean(x^2) + eps) is rounded to q's dtype, and so is weight * that.

    cos_cache[p] / sin_cache[p] have width rotary_dim / 2 (rotary_dim <= head_dim): the first rotary_dim
    channels of each head are rotated as halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the rest
    pass through. Returns new (q, k), float32 (the pool store is kv_store_ref of k rounded to its dtype,
    and v)."""
    half = cos_cache.shape[1]
    cos = cos_cache[positions.long()].float()[:, None, :]
    sin = sin_cache[positions.long()].float()[:, None, :]

    def norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        heads = x.reshape(x.shape[0], -1, head_dim)
        normed = rmsnorm_ref(heads, torch.ones_like(weight), eps).to(x.dtype)
        return (weight * normed).to(x.dtype).reshape(x.shape)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(x.shape[0], -1, head_dim)
        x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).reshape(x.shape[0], -1)

    return rotate(norm(q, q_weight)), rotate(norm(k, k_weight))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2d] -> silu(x[:, :d]) * x[:, d:]."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts MLP. x [n, hidden]; w13 [experts, 2 * inter, hidden] (gate rows then up rows);
    w2 [experts, hidden, inter]; topk_weights/topk_ids [n, k]. Returns
    sum_j topk_weights[:, j] * w2[e_j] @ silu_and_mul(w13[e_j] @ x), one expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        hidden = silu_and_mul_ref(xf[tokens] @ w13[e].float().T)
        contrib = (hidden @ w2[e].float().T) * topk_weights[tokens, slot].float()[:, None]
        out.index_add_(0, tokens, contrib)
    return out
