"""Check and time every Triton kernel in kernels/ at real Qwen3 shapes on one GPU.

    python bench/gpu_kernels.py            (from the repository root; needs torch + triton, a CUDA GPU)

Each case draws fresh random inputs, poisons the output with NaN, runs the kernel, compares it with the
float32 reference in kernels/reference.py (bf16 inputs: ||out - ref|| / ||ref|| < 1e-2), then times it
with triton.testing.do_bench (median, CUDA events). Inputs are rotated among enough copies to exceed
4x the L2 cache, so memory-bound figures are DRAM figures. Every figure is printed next to its ceiling
measured in the same run: device-to-device copy bandwidth (read + write bytes) for memory-bound kernels,
a bf16 8192^3 matmul for extend attention. A short table closes the output.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable without an install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import reference as ref  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    MIN_TOKENS_PER_SPLIT,
    DecodeTiles,
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from kernels.extend_attention import (  # noqa: E402
    ExtendTiles,
    alloc_extend_partials,
    extend_attention,
    extend_block_table,
)
from kernels.fused_moe import fused_moe  # noqa: E402
from kernels.kv_store import store_kv  # noqa: E402
from kernels.qk_norm_rope import qk_norm_rope_  # noqa: E402
from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from kernels.sampling import gumbel_argmax  # noqa: E402
from kernels.sampling import hashed_uniform as kernel_uniform  # noqa: E402
from services.worker.runtime.attention.triton_backend import extend_split_slots  # noqa: E402
from services.worker.runtime.sampling.sampler import gumbel_noise, hashed_uniform  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16
TOL = 1e-2
MODELS = {"qwen3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # q heads, kv heads, head_dim


_gen = torch.Generator().manual_seed(1)
_mixed = torch.randint(1024, 4097, (64,), generator=_gen).tolist()
_ext = torch.randint(512, 2049, (4,), generator=_gen).tolist()
# case name -> seq_lens (one decode token per request, attending to the whole sequence)
DECODE_CASES = {"bs1 ctx4k": [4096], "bs1 ctx32k": [32768], "bs64 ctx1k-4k": _mixed}
# case name -> (prefix_lens, new-token counts)
EXTEND_CASES = {
    "1x2048 new, prefix 0": ([0], [2048]),
    "4x1024 new, prefix 0": ([0] * 4, [1024] * 4),
    f"4x{min(_ext)}-{max(_ext)} new, prefix 0": ([0] * 4, _ext),
    f"4x{min(_ext)}-{max(_ext)} new, prefix 2048": ([2048] * 4, _ext),
    # A mixed step late in a 32k prompt: one short chunk after a long prefix (split over programs).
    "1x128 new, prefix 30720": ([30720], [128]),
}
ELEMENTWISE_TOKENS = 16384
MOE_SHAPE = (128, 8, 2048, 768)  # Qwen3-30B-A3B: experts, top-k, hidden, moe intermediate
MOE_TOKENS = (16, 4096)  # a decode batch, a prefill chunk


@dataclass
class Row:
    kernel: str
    case: str
    us: float
    achieved: float
    unit: str
    ceiling: float
    err: float
    peer_us: float | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.err) and self.err < TOL


ROWS: list[Row] = []  # the default configuration of every kernel: the closing table
VARIANT_ROWS: list[Row] = []  # other launch shapes tried on Qwen3-8B, printed before it

DECODE_VARIANTS = {  # name -> (stage-1 tiles, min tokens per split); the first is the default
    "default": (None, MIN_TOKENS_PER_SPLIT),
    "split128": (None, 128),
    "split512": (None, 512),
    "n32": (DecodeTiles(block_n=32), MIN_TOKENS_PER_SPLIT),
    "n128w8": (DecodeTiles(block_n=128, num_warps=8), MIN_TOKENS_PER_SPLIT),
    "stages3": (DecodeTiles(num_stages=3), MIN_TOKENS_PER_SPLIT),
}
EXTEND_VARIANTS = {
    "default": ExtendTiles(),
    "128x128": ExtendTiles(block_n=128),
    "stages3": ExtendTiles(num_stages=3),
    "64x64w4": ExtendTiles(block_m=64, block_n=64, num_warps=4),
}


def rel_err(out: torch.Tensor, expect: torch.Tensor) -> float:
    out64, ref64 = out.double(), expect.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm())


def bench_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def device_facts() -> tuple[str, int, int]:
    """(name, SM count, L2 bytes)."""
    props = torch.cuda.get_device_properties(DEV)
    return props.name, props.multi_processor_count, props.L2_cache_size


def copies_for(bytes_per_copy: int) -> int:
    """Input sets to rotate through so one pass over all of them is > 4x L2."""
    l2 = device_facts()[2]
    return max(1, min(32, math.ceil(4 * l2 / max(bytes_per_copy, 1))))


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def check_and_time(
    kind: str, name: str, default: bool, check: Callable[[], float], timed: Callable[[], object]
) -> tuple[float, float] | None:
    """(check()'s error against the reference, timed's median ms) for one launch variant. A variant
    other than the default that fails (one that does not compile) is reported and gives None."""
    try:
        return check(), bench_ms(timed)
    except Exception as exc:
        if default:
            raise
        print(f"  {kind} variant {name} failed: {type(exc).__name__}: {exc}"[:300])
        return None


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
    n = 1 << 30  # 1 GiB
    src = torch.randn(n // 2, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    gbps = 2 * n / (bench_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
    a = torch.randn((8192, 8192), device=DEV, dtype=DT)
    b = torch.randn((8192, 8192), device=DEV, dtype=DT)
    tflops = 2 * 8192**3 / (bench_ms(lambda: a @ b) * 1e-3) / 1e12
    return gbps, tflops


def paged_pool(seq_lens: list[int], kv_heads: int, head_dim: int, extra_rows: int = 0):
    """A pool holding every token of every request at shuffled 1-token slots (the fragmented case)."""
    total = sum(seq_lens)
    k_buf = torch.randn((total + 1, kv_heads, head_dim), device=DEV, dtype=DT)
    v_buf = torch.randn((total + 1, kv_heads, head_dim), device=DEV, dtype=DT)
    table = torch.zeros((len(seq_lens) + extra_rows, max(seq_lens)), dtype=torch.int32, device=DEV)
    slots = (torch.randperm(total, device=DEV) + 1).to(torch.int32)
    start = 0
    for i, n in enumerate(seq_lens):
        table[i, :n] = slots[start : start + n]
        start += n
    rows = torch.arange(len(seq_lens), dtype=torch.int64, device=DEV)
    return k_buf, v_buf, table, rows


def bench_decode(
    model: str, seq_lens: list[int], case: str, copy_gbps: float, variants: dict[str, tuple[DecodeTiles | None, int]]
) -> None:
    """Check and time each variant (tiles, min tokens per split); the first is the default config."""
    heads, kv_heads, head_dim = MODELS[model]
    bs = len(seq_lens)
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * 2
    max_splits = max_kv_splits_for(bs, kv_heads, device_facts()[1])
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    part_out, part_lse = alloc_decode_partials(bs, heads, max_splits, head_dim, DEV)
    counters = alloc_split_counters(bs, kv_heads, DEV)
    scale = head_dim**-0.5
    sets = []
    for _ in range(copies_for(kv_bytes)):
        k_buf, v_buf, table, rows = paged_pool(seq_lens, kv_heads, head_dim)
        q = torch.randn((bs, heads * head_dim), device=DEV, dtype=DT)
        sets.append((q, k_buf, v_buf, table, rows, torch.empty_like(q)))
    q, k_buf, v_buf, table, rows, out = sets[0]
    expect = ref.decode_attention_ref(q, k_buf, v_buf, table, rows, lens, scale)
    peer = None
    if bs == 1:
        # Peer: SDPA over the same context stored densely (no paging, no gather).
        kd = torch.randn((1, kv_heads, seq_lens[0], head_dim), device=DEV, dtype=DT)
        vd, qd = torch.randn_like(kd), torch.randn((1, heads, 1, head_dim), device=DEV, dtype=DT)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        peer = bench_ms(lambda: sdpa(qd, kd, vd, enable_gqa=True)) * 1e3
    for i, (name, (tiles, min_tokens)) in enumerate(variants.items()):
        splits = kv_splits_per_request(lens, max_splits, min_tokens_per_split=min_tokens)

        def launch(s, splits=splits, tiles=tiles) -> object:
            return decode_attention(
                s[0], s[1], s[2], s[5], s[3], s[4], lens, splits, max_splits, scale, part_out, part_lse, tiles,
                split_counters=counters,
            )

        def check(launch=launch) -> float:
            part_out.fill_(float("nan"))
            out.fill_(float("nan"))
            launch(sets[0])
            return rel_err(out, expect)

        measured = check_and_time("decode", name, i == 0, check, rotating([lambda s=s: launch(s) for s in sets]))
        if measured is None:
            continue
        err, ms = measured
        row = Row(
            "decode_attn", f"{model} {case} [{name}] splits<={max_splits}", ms * 1e3,
            kv_bytes / (ms * 1e-3) / 1e9, "GB/s", copy_gbps, err, peer,
        )  # fmt: skip
        (ROWS if i == 0 else VARIANT_ROWS).append(row)


def bench_extend(
    model: str,
    prefix_lens: list[int],
    extend_lens: list[int],
    case: str,
    mm_tflops: float,
    variants: dict[str, ExtendTiles],
) -> None:
    """Check and time each tile variant; the first is the default config."""
    heads, kv_heads, head_dim = MODELS[model]
    tokens = sum(extend_lens)
    scale = head_dim**-0.5
    k_buf, v_buf, table, rows = paged_pool(
        [p + e for p, e in zip(prefix_lens, extend_lens)], kv_heads, head_dim
    )
    q = torch.randn((tokens, heads * head_dim), device=DEV, dtype=DT)
    k = torch.randn((tokens, kv_heads * head_dim), device=DEV, dtype=DT)
    v = torch.randn((tokens, kv_heads * head_dim), device=DEV, dtype=DT)
    out = torch.empty_like(q)
    prefix_t = torch.tensor(prefix_lens, dtype=torch.int32, device=DEV)
    indptr = torch.tensor([0, *extend_lens], device=DEV).cumsum(0).to(torch.int32)
    expect = ref.extend_attention_ref(q, k, v, k_buf, v_buf, table, rows, prefix_lens, extend_lens, scale)
    # Useful FLOPs only: QK^T and PV over the visible (prefix + causal) keys.
    flops = sum(4 * heads * head_dim * e * (p + (e + 1) / 2) for p, e in zip(prefix_lens, extend_lens))
    peer = None
    if all(p == 0 for p in prefix_lens) and len(set(extend_lens)) == 1:
        shape = (len(extend_lens), extend_lens[0], -1, head_dim)
        qd, kd, vd = (x.view(shape).transpose(1, 2) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        peer = bench_ms(lambda: sdpa(qd, kd, vd, is_causal=True, enable_gqa=True)) * 1e3
    sms = device_facts()[1]
    slots = extend_split_slots(heads)
    runs = [(name, tiles, True) for name, tiles in variants.items()] + [("unsplit", next(iter(variants.values())), False)]
    for i, (name, tiles, split) in enumerate(runs):
        # As the engine builds it: prefixes split over programs while the SMs are not busy.
        blocks = extend_block_table(
            prefix_lens, extend_lens, tiles.block_m, num_heads=heads, num_sms=sms if split else 0,
            max_split_slots=slots,
        ).to(DEV)  # fmt: skip
        partials = alloc_extend_partials(slots, heads, tiles.block_m, head_dim, DEV)

        def run(tiles=tiles, blocks=blocks, partials=partials) -> object:
            return extend_attention(
                q, k, v, out, k_buf, v_buf, table, rows, prefix_t, indptr, blocks, scale, tiles, partials
            )

        def check(run=run) -> float:
            out.fill_(float("nan"))
            run()
            return rel_err(out, expect)

        measured = check_and_time("extend", name, i == 0, check, run)
        if measured is None:
            continue
        err, ms = measured
        row = Row(
            "extend_attn", f"{model} {case} [{name}]", ms * 1e3, flops / (ms * 1e-3) / 1e12, "TFLOP/s",
            mm_tflops, err, peer,
        )  # fmt: skip
        (ROWS if i == 0 else VARIANT_ROWS).append(row)


def moe_peer(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Torch peer: one matmul pair per expert over its tokens (the CPU backend's approach)."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tokens, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (x[tokens] @ w13[e].T).chunk(2, dim=-1)
        contrib = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        out.index_add_(0, tokens, contrib * topk_weights[tokens, slot, None].to(x.dtype))
    return out


def bench_moe(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, copy_gbps: float, mm_tflops: float
):
    """Qwen3-MoE layer shape. Few tokens: weight streaming (GB/s of the experts hit); many: TFLOP/s."""
    x = torch.randn((tokens, hidden), device=DEV, dtype=DT)
    w13 = (torch.randn((experts, 2 * inter, hidden), device=DEV) / hidden**0.5).to(DT)
    w2 = (torch.randn((experts, hidden, inter), device=DEV) / inter**0.5).to(DT)
    probs = torch.softmax(torch.randn((tokens, experts), device=DEV), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = fused_moe(x, w13, w2, weights, ids)
    err = rel_err(out, ref.fused_moe_ref(x, w13, w2, weights, ids))
    ms = bench_ms(lambda: fused_moe(x, w13, w2, weights, ids))
    peer = bench_ms(lambda: moe_peer(x, w13, w2, weights, ids)) * 1e3
    case = f"T={tokens} E={experts} k={top_k} H={hidden} I={inter}"
    if tokens * top_k <= 2 * experts:
        weight_bytes = int(torch.unique(ids).numel()) * 3 * hidden * inter * 2
        ROWS.append(
            Row("fused_moe", case, ms * 1e3, weight_bytes / (ms * 1e-3) / 1e9, "GB/s", copy_gbps, err, peer)
        )
    else:
        flops = 6 * tokens * top_k * hidden * inter
        ROWS.append(
            Row("fused_moe", case, ms * 1e3, flops / (ms * 1e-3) / 1e12, "TFLOP/s", mm_tflops, err, peer)
        )


def bench_memory_bound(
    name: str,
    case: str,
    nbytes: int,
    make: Callable[[], tuple[Callable[[], object], Callable[[], float]]],
    copy_gbps: float,
) -> None:
    """make() -> (run, check): run launches the kernel on one fresh input set; check returns the
    error of the first set's output against the reference."""
    sets = [make() for _ in range(copies_for(nbytes))]
    err = sets[0][1]()
    ms = bench_ms(rotating([s[0] for s in sets]))
    ROWS.append(Row(name, case, ms * 1e3, nbytes / (ms * 1e-3) / 1e9, "GB/s", copy_gbps, err))


def rmsnorm_case(tokens: int, hidden: int, fused: bool):
    def make():
        x = torch.randn((tokens, hidden), device=DEV, dtype=DT)
        r = torch.randn((tokens, hidden), device=DEV, dtype=DT)
        w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(DT)
        if fused:

            def check() -> float:
                normed, total = fused_add_rmsnorm(x, r, w, 1e-6)
                en, et = ref.fused_add_rmsnorm_ref(x, r, w, 1e-6)
                return max(rel_err(normed, en), rel_err(total, et))

            return (lambda: fused_add_rmsnorm(x, r, w, 1e-6)), check
        out = torch.full_like(x, float("nan"))

        def check_plain() -> float:
            rmsnorm(x, w, 1e-6, out=out)
            return rel_err(out, ref.rmsnorm_ref(x, w, 1e-6))

        return (lambda: rmsnorm(x, w, 1e-6, out=out)), check_plain

    return make


def rotary_case(tokens: int, heads: int, kv_heads: int, head_dim: int):
    half = head_dim // 2
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    freqs = torch.outer(torch.arange(40960, device=DEV).float(), inv_freq)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    assert cos.shape[1] == half

    def make():
        qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), device=DEV, dtype=DT)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        pos = torch.randint(0, 40960, (tokens,), device=DEV)

        def check() -> float:
            eq, ek = ref.qk_norm_rope_ref(pos, q, k, cos, sin, head_dim)
            qk_norm_rope_(pos, q, k, cos, sin, head_dim)
            return max(rel_err(q, eq), rel_err(k, ek))

        return (lambda: qk_norm_rope_(pos, q, k, cos, sin, head_dim)), check

    return make


def qk_norm_rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, pool_slots: int):
    """Qwen3's per-head q/k RMSNorm + rotary + KV store in one launch, against the unfused reference."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    freqs = torch.outer(torch.arange(40960, device=DEV).float(), inv_freq)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def make():
        qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), device=DEV, dtype=DT)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        pos = torch.randint(0, 40960, (tokens,), device=DEV)
        qw = (1 + 0.1 * torch.randn(head_dim, device=DEV)).to(DT)
        kw = (1 + 0.1 * torch.randn(head_dim, device=DEV)).to(DT)
        k_buf = torch.randn((pool_slots + 1, kv_heads, head_dim), device=DEV, dtype=DT)
        v_buf = torch.randn_like(k_buf)
        loc = torch.randperm(pool_slots, device=DEV)[:tokens] + 1
        kw_args = dict(q_weight=qw, k_weight=kw, eps=1e-6, v=v, k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=loc)

        def check() -> float:
            eq, ek = ref.qk_norm_rope_ref(pos, q, k, cos, sin, head_dim, qw, kw, 1e-6)
            ev = v.clone()
            k_buf[loc] = float("nan")
            v_buf[loc] = float("nan")
            qk_norm_rope_(pos, q, k, cos, sin, head_dim, **kw_args)
            return max(
                rel_err(q, eq), rel_err(k, ek),
                rel_err(k_buf[loc].flatten(1), ek), rel_err(v_buf[loc].flatten(1), ev),
            )  # fmt: skip

        return (lambda: qk_norm_rope_(pos, q, k, cos, sin, head_dim, **kw_args)), check

    return make


def silu_case(tokens: int, d: int):
    def make():
        x = torch.randn((tokens, 2 * d), device=DEV, dtype=DT)
        out = torch.full((tokens, d), float("nan"), device=DEV, dtype=DT)

        def check() -> float:
            silu_and_mul(x, out=out)
            return rel_err(out, ref.silu_and_mul_ref(x))

        return (lambda: silu_and_mul(x, out=out)), check

    return make


def kv_store_case(tokens: int, kv_heads: int, head_dim: int, pool_slots: int):
    def make():
        k_buf = torch.randn((pool_slots + 1, kv_heads, head_dim), device=DEV, dtype=DT)
        v_buf = torch.randn_like(k_buf)
        k = torch.randn((tokens, kv_heads * head_dim), device=DEV, dtype=DT)
        v = torch.randn_like(k)
        loc = torch.randperm(pool_slots, device=DEV)[:tokens] + 1

        def check() -> float:
            k_buf[loc] = float("nan")
            v_buf[loc] = float("nan")
            store_kv(k_buf, v_buf, loc, k, v)
            ek, ev = k_buf.clone(), v_buf.clone()
            ref.kv_store_ref(ek, ev, loc, k, v)
            return max(rel_err(k_buf[loc], ek[loc]), rel_err(v_buf[loc], ev[loc]))

        return (lambda: store_kv(k_buf, v_buf, loc, k, v)), check

    return make


def bench_gumbel_argmax(bs: int, vocab: int, copy_gbps: float) -> None:
    """Temperature sampling's Gumbel-max over the whole vocabulary (sampler.py's path without top-k/top-p):
    bf16 logits / temperature in float32, the fused kernel against the torch ops it replaces (the peer).
    err counts rows whose token differs from torch's by more than a 1e-6 relative near-tie of the
    perturbed scores (a last-bit log difference), so one wrong row fails; a hashed uniform that is not
    bit-identical to the sampler's gives inf."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (bs,), dtype=torch.int64).to(DEV)
    positions = torch.randint(0, 40960, (bs,), device=DEV)
    temperatures = torch.empty((bs, 1), device=DEV).uniform_(0.5, 1.5)
    vocab_ids = torch.arange(vocab, device=DEV).unsqueeze(0)
    nbytes = bs * vocab * 4
    sets = [
        torch.randn((bs, vocab), device=DEV, dtype=DT).float() / temperatures
        for _ in range(copies_for(nbytes))
    ]
    scores = sets[0] + gumbel_noise(seeds, positions, vocab_ids)
    best = scores.max(dim=-1).values
    got = gumbel_argmax(sets[0], seeds, positions)
    chosen = scores.gather(1, got.unsqueeze(1)).squeeze(1)
    differs = got != scores.argmax(dim=-1)
    err = float((differs & (chosen < best - 1e-6 * best.abs())).sum())
    if not torch.equal(kernel_uniform(seeds, positions, vocab), hashed_uniform(seeds, positions, vocab_ids)):
        err = float("inf")
    print(f"gumbel_argmax: {int(differs.sum())}/{bs} rows pick another token than torch.argmax", flush=True)
    ms = bench_ms(rotating([lambda s=s: gumbel_argmax(s, seeds, positions) for s in sets]))
    peer = bench_ms(
        rotating([lambda s=s: (s + gumbel_noise(seeds, positions, vocab_ids)).argmax(-1) for s in sets])
    )
    ROWS.append(
        Row("gumbel_argmax", f"bs{bs} V{vocab} (bf16 logits / T)", ms * 1e3, nbytes / (ms * 1e-3) / 1e9, "GB/s",
            copy_gbps, err, peer * 1e3)
    )  # fmt: skip


def main() -> int:
    torch.manual_seed(0)
    name, sms, l2 = device_facts()
    print(
        f"device: {name}, {sms} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}, triton {triton.__version__}"
    )
    copy_gbps, mm_tflops = measure_ceilings()
    print(f"ceilings: copy {copy_gbps:.0f} GB/s (read+write), bf16 matmul {mm_tflops:.0f} TFLOP/s")

    first = next(iter(MODELS))
    bar = progress_bar(desc="attention cases", total=len(MODELS) * (len(DECODE_CASES) + len(EXTEND_CASES)),
                       lines_when_piped=False)
    for model in MODELS:
        variants = DECODE_VARIANTS if model == first else dict(list(DECODE_VARIANTS.items())[:1])
        for case, seq_lens in DECODE_CASES.items():
            bench_decode(model, seq_lens, case, copy_gbps, variants)
            bar.update()
        say(f"decode {model} done")
    for model in MODELS:
        variants = EXTEND_VARIANTS if model == first else dict(list(EXTEND_VARIANTS.items())[:1])
        for case, (prefix_lens, extend_lens) in EXTEND_CASES.items():
            bench_extend(model, prefix_lens, extend_lens, case, mm_tflops, variants)
            bar.update()
        say(f"extend {model} done")
    bar.close()

    t, hidden, inter = ELEMENTWISE_TOKENS, 4096, 12288
    bench_memory_bound(
        "fused_add_rmsnorm", f"{t}x{hidden}", 4 * t * hidden * 2, rmsnorm_case(t, hidden, True), copy_gbps
    )
    bench_memory_bound(
        "rmsnorm", f"{t}x{hidden}", 2 * t * hidden * 2, rmsnorm_case(t, hidden, False), copy_gbps
    )
    qk_bytes = 2 * t * (32 + 8) * 128 * 2
    bench_memory_bound(
        "rotary_neox", f"{t} tok 32q/8kv x128", qk_bytes, rotary_case(t, 32, 8, 128), copy_gbps
    )
    qkv_bytes = 2 * t * (32 + 8) * 128 * 2 + 2 * t * 8 * 128 * 2 * 2
    bench_memory_bound(
        "qk_norm_rope+store", f"{t} tok 32q/8kv x128", qkv_bytes, qk_norm_rope_case(t, 32, 8, 128, 4 * t), copy_gbps
    )
    bench_memory_bound("silu_and_mul", f"{t}x(2x{inter})", 3 * t * inter * 2, silu_case(t, inter), copy_gbps)
    n = t // 2
    bench_memory_bound(
        "kv_store", f"{n} tok 8kv x128", 2 * 2 * n * 8 * 128 * 2, kv_store_case(n, 8, 128, 4 * n), copy_gbps
    )
    bench_gumbel_argmax(256, 151936, copy_gbps)

    for tokens in progress_bar(MOE_TOKENS, desc="MoE token counts", lines_when_piped=False):
        bench_moe(tokens, *MOE_SHAPE, copy_gbps, mm_tflops)
    print("moe done", flush=True)

    print_table("launch-shape variants (Qwen3-8B)", VARIANT_ROWS)
    print_table("default configuration", ROWS)
    if os.environ.get("OUT"):
        # The device machine's output folder: keep every figure (recorded runs go to bench/results/).
        with open(os.path.join(os.environ["OUT"], "gpu_kernels.json"), "w") as f:
            json.dump({"copy_gbps": copy_gbps, "matmul_tflops": mm_tflops,
                       "rows": [asdict(r) for r in ROWS], "variants": [asdict(r) for r in VARIANT_ROWS]}, f, indent=1)  # fmt: skip
    failed = [r for r in ROWS + VARIANT_ROWS if not r.ok]
    print(
        f"\n{len(ROWS) + len(VARIANT_ROWS) - len(failed)}/{len(ROWS) + len(VARIANT_ROWS)} checks passed (rel err < {TOL})"
    )
    return 1 if failed else 0


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    header = f"{'kernel':<18} {'case':<58} {'time us':>9} {'achieved':>16} {'ceiling':>10} {'ratio':>6} {'rel err':>9} {'peer us':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        peer = f"{r.peer_us:8.1f}" if r.peer_us is not None else f"{'-':>8}"
        flag = "" if r.ok else "  FAIL"
        print(
            f"{r.kernel:<18} {r.case:<58} {r.us:9.1f} {r.achieved:9.1f} {r.unit:<6} {r.ceiling:10.0f} "
            f"{r.achieved / r.ceiling:6.2f} {r.err:9.2e} {peer}{flag}"
        )


if __name__ == "__main__":
    sys.exit(main())
