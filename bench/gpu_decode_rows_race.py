"""Decode rows of one request in one fused launch: the race the attention backend keeps out.

    python bench/gpu_decode_rows_race.py [--trials 300]   (GPU, repository root)

Speculative verification runs [last token, proposals...] of a request as decode rows, row j attending to
the new tokens of rows 0 .. j-1 (ScheduleBatch.prepare_rows; a draft's catch-up does the same). With the
q/k norm, rotary and KV store folded into decode attention (kernels/decode_rope.py), each of those tokens
is stored by another program of the same launch, so whether row j reads it before it is stored depends on
scheduling. This runs k + 1 = 4 rows of one request, and as the control 4 rows of 4 requests, through the
fused launch and through the two launches it replaces (qk_norm_rope_, then decode_attention), --trials
times each from the same pool, and counts the trials whose outputs differ from the two launches' (Qwen3-0.6B
heads, bf16, 300 cached tokens). The triton backend keeps the prologue a launch of its own wherever decode
rows share requests (AttentionBackend.decode_rows_share_requests). Prints a table; JSON to
$OUT/gpu_decode_rows_race.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_common import OUT  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from kernels.decode_rope import DecodeRope  # noqa: E402
from kernels.qk_norm_rope import qk_norm_rope_  # noqa: E402
from services.worker.runtime.layers.rotary import RotaryEmbedding  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CACHED, ROWS = 16, 8, 128, 300, 4
DEV, DT = "cuda", torch.bfloat16


def rotary(max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's rotary tables (theta 1e6) for positions below max_pos, as the model's RotaryEmbedding holds them."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    rope = RotaryEmbedding(HEAD_DIM, inv_freq, max_pos).to(DEV)
    return rope.cos_cache, rope.sin_cache


def case(shared: bool, gen: torch.Generator) -> dict:
    """Pool, request table and the four rows' metadata: rows of one request (positions CACHED .. CACHED+3)
    or of four requests (each at position CACHED)."""
    requests = 1 if shared else ROWS
    slots = requests * (CACHED + ROWS) + 1
    k_buf = torch.randn((slots, KV_HEADS, HEAD_DIM), generator=gen, device=DEV).to(DT)
    v_buf = torch.randn((slots, KV_HEADS, HEAD_DIM), generator=gen, device=DEV).to(DT)
    table = torch.zeros((requests, CACHED + ROWS + 64), dtype=torch.int32, device=DEV)
    perm = torch.randperm(slots - 1, generator=gen, device=DEV) + 1
    for r in range(requests):
        table[r, : CACHED + ROWS] = perm[r * (CACHED + ROWS) : (r + 1) * (CACHED + ROWS)].to(torch.int32)
    if shared:
        rows = torch.zeros(ROWS, dtype=torch.int64, device=DEV)
        positions = torch.arange(CACHED, CACHED + ROWS, device=DEV)
    else:
        rows = torch.arange(ROWS, device=DEV)
        positions = torch.full((ROWS,), CACHED, device=DEV)
    loc = table[rows, positions].to(torch.int64)
    qkv = torch.randn((ROWS, (HEADS + 2 * KV_HEADS) * HEAD_DIM), generator=gen, device=DEV).to(DT)
    return {"k": k_buf, "v": v_buf, "table": table, "rows": rows, "positions": positions, "loc": loc, "qkv": qkv}


def attend(c: dict, fused: bool, cos: torch.Tensor, sin: torch.Tensor, w: tuple) -> torch.Tensor:
    k_buf, v_buf, qkv = c["k"].clone(), c["v"].clone(), c["qkv"].clone()
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    seq_lens = c["positions"] + 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_splits = max_kv_splits_for(ROWS, KV_HEADS, sms)
    splits = kv_splits_per_request(seq_lens, max_splits)
    part_out, part_lse = alloc_decode_partials(ROWS, HEADS, max_splits, HEAD_DIM, DEV)
    out = torch.empty((ROWS, q_size), dtype=DT, device=DEV)
    rope = None
    if fused:
        rope = DecodeRope(c["positions"], k, v, cos, sin, c["loc"], w[0], w[1], 1e-6)
    else:
        qk_norm_rope_(
            c["positions"], q, k, cos, sin, HEAD_DIM, q_weight=w[0], k_weight=w[1], eps=1e-6, v=v,
            k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=c["loc"],
        )  # fmt: skip
    decode_attention(
        q, k_buf, v_buf, out, c["table"], c["rows"], seq_lens, splits, max_splits, HEAD_DIM**-0.5, part_out,
        part_lse, split_counters=alloc_split_counters(ROWS, KV_HEADS, DEV), rope=rope,
    )  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=300)
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    cos, sin = rotary(CACHED + ROWS + 64)
    w = ((torch.rand(HEAD_DIM, generator=gen, device=DEV) + 0.5).to(DT),
         (torch.rand(HEAD_DIM, generator=gen, device=DEV) + 0.5).to(DT))
    results = []
    for shared in (True, False):
        c = case(shared, gen)
        ref = attend(c, False, cos, sin, w)
        differ = 0
        worst = 0.0
        for _ in range(args.trials):
            out = attend(c, True, cos, sin, w)
            if not torch.equal(out, ref):
                differ += 1
                worst = max(worst, (out.float() - ref.float()).abs().max().item())
        torch.cuda.synchronize()
        results.append({"rows": "one request" if shared else "four requests", "trials": args.trials,
                        "differ": differ, "max_abs_diff": worst})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_decode_rows_race.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                               "results": results}, indent=2))
    print(f"\n== fused decode prologue, {ROWS} rows, outputs against the two launches ({torch.cuda.get_device_name(0)}) ==")
    print(f"{'rows':>14} {'trials':>6} {'differ':>6} {'max |d|':>8}")
    for r in results:
        print(f"{r['rows']:>14} {r['trials']:>6} {r['differ']:>6} {r['max_abs_diff']:8.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
