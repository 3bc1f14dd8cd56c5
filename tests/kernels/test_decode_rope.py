"""decode_attention with its fused prologue (rope=DecodeRope: q/k norm, rotary and the new token's KV store)
against the two launches it replaces, qk_norm_rope_ then decode_attention, under the Triton interpreter.

The fused launch must give the same bits: the same attention output and the same pool afterwards (the new
token's K/V rows written, nothing else touched), for float32, bfloat16 and float8 pools, with several
splits per request, GQA groups and a padded row of length 0. Bad arguments are ValueErrors naming the
operand.
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import (
    DecodeTiles,
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
)
from kernels.decode_rope import DecodeRope, rope_fusable
from kernels.qk_norm_rope import qk_norm_rope_
from tests.kernels.conftest import poisoned, rotary_caches

EPS = 1e-6


class Case:
    """A decode batch: a fused qkv output (un-rotated), the pool without the new tokens' rows, and the
    metadata both paths take."""

    def __init__(
        self, gen, paged_kv, seq_lens, heads, kv_heads, head_dim, dtype, pool_dtype, with_norm
    ) -> None:
        self.kv = paged_kv(gen, seq_lens, kv_heads, head_dim, dtype)
        self.kv.k_buffer = self.kv.k_buffer.to(pool_dtype)
        self.kv.v_buffer = self.kv.v_buffer.to(pool_dtype)
        bs = len(seq_lens)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = (torch.randn((bs, (heads + 2 * kv_heads) * head_dim), generator=gen) * 2).to(dtype)
        lens = self.kv.seq_lens
        self.positions = torch.clamp(lens - 1, min=0)
        rows = self.kv.req_to_token[self.kv.req_pool_indices]
        # A row of length 0 (a padded CUDA-graph row) stores to spare slot 0, as the graph's padding does.
        self.loc = torch.where(lens > 0, rows.gather(1, self.positions[:, None])[:, 0], 0).to(torch.int64)
        self.cos, self.sin = rotary_caches(head_dim, int(lens.max()) + 1)
        self.weights = (
            (
                (torch.rand(head_dim, generator=gen) + 0.5).to(dtype),
                (torch.rand(head_dim, generator=gen) + 0.5).to(dtype),
            )
            if with_norm
            else (None, None)
        )
        self.max_splits = 8
        self.splits = kv_splits_per_request(lens, self.max_splits, min_tokens_per_split=16)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]

    def attend(self, q, k_buffer, v_buffer, scales, rope=None) -> torch.Tensor:
        bs = q.shape[0]
        part_out, part_lse = alloc_decode_partials(bs, self.heads, self.max_splits, self.head_dim, "cpu")
        out = poisoned((bs, self.heads * self.head_dim), q.dtype)
        decode_attention(
            q, k_buffer, v_buffer, out, self.kv.req_to_token, self.kv.req_pool_indices, self.kv.seq_lens,
            self.splits, self.max_splits, self.head_dim**-0.5, part_out, part_lse, DecodeTiles(block_n=16),
            alloc_split_counters(bs, self.kv_heads, "cpu"), k_scale=scales[0], v_scale=scales[1], rope=rope,
        )  # fmt: skip
        return out

    def unfused(self, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_buffer, v_buffer = self.kv.k_buffer.clone(), self.kv.v_buffer.clone()
        q, k, v = self.split_qkv(self.qkv.clone())
        qk_norm_rope_(
            self.positions, q, k, self.cos, self.sin, self.head_dim, q_weight=self.weights[0],
            k_weight=self.weights[1], eps=EPS, v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=self.loc,
            k_scale=scales[0], v_scale=scales[1],
        )  # fmt: skip
        return self.attend(q, k_buffer, v_buffer, scales), k_buffer, v_buffer

    def rope(self, qkv: torch.Tensor) -> DecodeRope:
        _, k, v = self.split_qkv(qkv)
        return DecodeRope(
            self.positions, k, v, self.cos, self.sin, self.loc, self.weights[0], self.weights[1], EPS
        )

    def fused(self, scales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_buffer, v_buffer = self.kv.k_buffer.clone(), self.kv.v_buffer.clone()
        qkv = self.qkv.clone()
        out = self.attend(self.split_qkv(qkv)[0], k_buffer, v_buffer, scales, self.rope(qkv))
        assert torch.equal(qkv, self.qkv), "the fused launch must not write its inputs"
        return out, k_buffer, v_buffer


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} differs"


@pytest.mark.parametrize(
    ("dtype", "pool_dtype", "scales"),
    [
        (torch.float32, torch.float32, (1.0, 1.0)),
        (torch.bfloat16, torch.bfloat16, (1.0, 1.0)),
        (torch.float32, torch.float8_e4m3fn, (0.5, 2.0)),
    ],
    ids=["f32", "bf16", "fp8-pool"],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "seq_lens"),
    [
        (4, 4, 32, [1, 37, 130, 0]),  # MHA; one token, one split, several splits, a padded row of length 0
        (8, 2, 16, [100, 5, 64]),  # GQA 4; a length that ends exactly on a split boundary
    ],
)
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "no_norm"])
def test_fused_prologue_gives_the_unfused_bits(
    gen, paged_kv, row_dot, dtype, pool_dtype, scales, heads, kv_heads, head_dim, seq_lens, with_norm
) -> None:
    case = Case(gen, paged_kv, seq_lens, heads, kv_heads, head_dim, dtype, pool_dtype, with_norm)
    ref_out, ref_k, ref_v = case.unfused(scales)
    out, k_buffer, v_buffer = case.fused(scales)
    _assert_same(k_buffer, ref_k, "the K pool")
    _assert_same(v_buffer, ref_v, "the V pool")
    _assert_same(out, ref_out, "the attention output")
    # And the pool did change: the new rows were stored (so the comparison above is not of two no-ops).
    assert not torch.equal(k_buffer.view(torch.uint8), case.kv.k_buffer.view(torch.uint8))


def test_rope_fusable_takes_whole_power_of_two_heads_only() -> None:
    assert rope_fusable(128, 128) and rope_fusable(64, 64)
    assert not rope_fusable(128, 64)  # partial rotary (Qwen3.5's gated attention)
    assert not rope_fusable(96, 96)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c, r: {"cos_cache": c.cos[:, :4], "sin_cache": c.sin[:, :4]}, "must rotate the whole head"),
        (lambda c, r: {"k": r.k[:, :16]}, "rope: k must be"),
        (lambda c, r: {"positions": c.positions[:2]}, "rope: positions must be"),
        (lambda c, r: {"k_weight": None}, "pass both"),
    ],
    ids=["partial-rotary", "k-shape", "positions", "one-weight"],
)
def test_bad_rope_arguments_are_clear_errors(gen, paged_kv, change, match) -> None:
    case = Case(gen, paged_kv, [20, 9, 40], 4, 2, 32, torch.float32, torch.float32, True)
    rope = case.rope(case.qkv)
    fields = {**rope.__dict__, **change(case, rope)}
    with pytest.raises(ValueError, match=match):
        case.attend(
            case.split_qkv(case.qkv)[0], case.kv.k_buffer, case.kv.v_buffer, (1.0, 1.0), DecodeRope(**fields)
        )
