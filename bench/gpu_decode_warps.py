"""Decode attention's warps per program at small batches: 4 against 8, as the decode step runs it.

    python bench/gpu_decode_warps.py   (GPU, repository root)
    python bench/gpu_decode_warps.py --split-tokens 64,128,256,1024   (batch 1: splits of each size)

A batch-1 decode step runs one decode attention per layer, each a few dependent memory round trips long
(the q/k norm and rotary, the store of the new K/V, one 64-key tile per program, the in-launch merge), and
the q heads of a GQA group are padded to 16 rows for the tensor cores. This times the launch with its
prologue (DecodeRope, as the triton backend runs it) in a CUDA graph of 28 launches one after another (PDL
on where the GPU has it), per launch, for Qwen3-0.6B heads (16 / 8) and Qwen3-8B heads (32 / 8), bf16, at
batch 1, 2, 4, 8, 16 and 31 and contexts of 256 and 1,024 tokens, with the narrow tiles
(kernels/decode_attention.py, 64-key tiles) at 4 and at 8 warps a program. Prints a table; JSON to
$OUT/gpu_decode_warps.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_common import OUT  # noqa: E402
from bench.gpu_decode_rows_race import rotary  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    NARROW_BATCH_TILES,
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from kernels.decode_rope import DecodeRope  # noqa: E402

HEAD_DIM, LAYERS = 128, 28
DEV, DT = "cuda", torch.bfloat16
SHAPES = {"0.6b": (16, 8), "8b": (32, 8)}


def time_case(heads: int, kv_heads: int, bs: int, ctx: int, warps: int, split_tokens: int = 64,
              block_n: int = 64) -> float:
    """Microseconds per launch over a graph of LAYERS launches (each its own layer's pool); a request's
    splits of `split_tokens` keys, tiles of `block_n`."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    slots = bs * ctx + 1
    pools = [(torch.randn((slots, kv_heads, HEAD_DIM), generator=gen, device=DEV).to(DT),
              torch.randn((slots, kv_heads, HEAD_DIM), generator=gen, device=DEV).to(DT)) for _ in range(LAYERS)]
    table = (torch.randperm(slots - 1, generator=gen, device=DEV) + 1).to(torch.int32).view(bs, ctx)
    rows = torch.arange(bs, device=DEV)
    seq_lens = torch.full((bs,), ctx, device=DEV)
    positions = seq_lens - 1
    loc = table[rows, positions].to(torch.int64)
    cos, sin = rotary(ctx + 1)
    w = (torch.rand(HEAD_DIM, generator=gen, device=DEV) + 0.5).to(DT)
    q_size, kv_size = heads * HEAD_DIM, kv_heads * HEAD_DIM
    qkv = torch.randn((bs, q_size + 2 * kv_size), generator=gen, device=DEV).to(DT)
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_splits = max_kv_splits_for(bs, kv_heads, sms)
    splits = kv_splits_per_request(seq_lens, max_splits, min_tokens_per_split=split_tokens)
    part_out, part_lse = alloc_decode_partials(bs, heads, max_splits, HEAD_DIM, DEV)
    counters = alloc_split_counters(bs, kv_heads, DEV)
    out = torch.empty((bs, q_size), dtype=DT, device=DEV)
    tiles = dataclasses.replace(NARROW_BATCH_TILES, num_warps=warps, block_n=block_n)
    rope = DecodeRope(positions, k, v, cos, sin, loc, w, w, 1e-6)

    def step() -> None:
        for kb, vb in pools:
            decode_attention(q, kb, vb, out, table, rows, seq_lens, splits, max_splits, HEAD_DIM**-0.5, part_out,
                             part_lse, tiles, counters, rope=rope)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / 20 / LAYERS)
    return best


def split_sizes(sizes: list[int]) -> int:
    """Batch 1 at 8 warps: a request's keys in splits of each size (kernels/decode_attention.py's
    MIN_TOKENS_PER_SPLIT is 64: more programs, and the in-launch merge) against fewer, longer splits."""
    rows = []
    for name, (heads, kv_heads) in SHAPES.items():
        for ctx in (128, 256, 512, 1024):
            for block_n in (64, 128):
                times = {size: time_case(heads, kv_heads, 1, ctx, 8, size, block_n) for size in sizes}
                rows.append({"model": name, "ctx": ctx, "block_n": block_n, "us": times})
                print(name, ctx, block_n, " ".join(f"{k}:{v:.2f}" for k, v in times.items()), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_decode_splits.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2)
    )
    print(f"\n== batch-1 decode attention with its prologue, us per launch (graph of {LAYERS}) by split size, "
          f"{torch.cuda.get_device_name(0)} ==")
    print(f"{'model':>5} {'ctx':>5} {'tile':>4} " + " ".join(f"{s:>7}" for s in sizes))
    for r in rows:
        print(f"{r['model']:>5} {r['ctx']:>5} {r['block_n']:>4} " + " ".join(f"{r['us'][s]:7.2f}" for s in sizes))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split-tokens", default=None, help="comma-separated split sizes: batch 1 by split size only")
    args = ap.parse_args()
    if args.split_tokens:
        return split_sizes([int(size) for size in args.split_tokens.split(",")])
    rows = []
    for name, (heads, kv_heads) in SHAPES.items():
        for ctx in (256, 1024):
            for bs in (1, 2, 4, 8, 16, 31):
                t4, t8 = (time_case(heads, kv_heads, bs, ctx, w) for w in (4, 8))
                rows.append({"model": name, "ctx": ctx, "bs": bs, "us_4_warps": t4, "us_8_warps": t8})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_decode_warps.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2)
    )
    print(f"\n== decode attention with its prologue, us per launch (graph of {LAYERS}), {torch.cuda.get_device_name(0)} ==")
    print(f"{'model':>5} {'ctx':>5} {'bs':>3} {'4 warps':>8} {'8 warps':>8} {'8/4':>6}")
    for r in rows:
        print(f"{r['model']:>5} {r['ctx']:>5} {r['bs']:>3} {r['us_4_warps']:8.2f} {r['us_8_warps']:8.2f} "
              f"{r['us_8_warps'] / r['us_4_warps']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
