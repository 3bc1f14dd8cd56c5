"""Decode attention launch shapes on the GPU: which grid order, K-tile layout, tile size and split
bound read the KV pool fastest, at the batch shapes the serving figures run.

    python bench/gpu_decode_sweep.py [--json gpu_decode_sweep.json]

Cases (Qwen3-0.6B heads: 16 query, 8 KV, head_dim 128; bf16):
- "p3 bs256": P3's decode batch at its widest, context lengths uniform in [100, 2048]. Slots laid out as
  the scheduler leaves them: each prompt contiguous, then the generated tokens of all requests
  interleaved (one slot per request per step), so a request's later keys are 256 slots apart.
- the same lengths at shuffled one-token slots (the most fragmented pool);
- "bs64 1k-4k" and the batch-1 cases of bench/gpu_kernels.py, so a change that helps the wide batch
  is seen not to cost the narrow ones.
Every variant is checked against the float32 reference before it is timed; GB/s counts the K and V
bytes each request's context holds, against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_common import OUT  # noqa: E402
from bench.gpu_kernels import (  # noqa: E402
    DEV,
    DT,
    bench_ms,
    copies_for,
    device_facts,
    measure_ceilings,
    paged_pool,
    rel_err,
    rotating,
)
from kernels import reference as ref  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    MIN_TOKENS_PER_SPLIT,
    DecodeTiles,
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from shared.progress import progress_bar, say  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def p3_pool(seq_lens: list[int], prompt_lens: list[int]):
    """Prompts contiguous, then generated tokens interleaved across requests, as decode steps allocate."""
    total = sum(seq_lens)
    k_buf = torch.randn((total + 1, KV_HEADS, HEAD_DIM), device=DEV, dtype=DT)
    v_buf = torch.randn_like(k_buf)
    table = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int32)
    nxt = 1
    for i, p in enumerate(prompt_lens):
        table[i, :p] = torch.arange(nxt, nxt + p, dtype=torch.int32)
        nxt += p
    gen = [n - p for n, p in zip(seq_lens, prompt_lens)]
    for t in range(max(gen)):
        for i, g in enumerate(gen):
            if t < g:
                table[i, prompt_lens[i] + t] = nxt
                nxt += 1
    rows = torch.arange(len(seq_lens), dtype=torch.int64, device=DEV)
    return k_buf, v_buf, table.to(DEV), rows


def variants() -> dict[str, tuple[DecodeTiles | None, int, int]]:
    """name -> (tiles, min tokens per split, factor on the default split bound). "default" is what
    decode_attention picks (tiles_for), "old" the launch shape before 2026-11-29's change
    (bench/HISTORY.md, "GPU, sixth session")."""
    d = MIN_TOKENS_PER_SPLIT
    out = {
        "default": (None, d, 1),
        "old": (DecodeTiles(head_major=False, k_rows=False), d, 1),
        "head_major": (DecodeTiles(head_major=True, k_rows=False), d, 1),
        "k_rows": (DecodeTiles(head_major=False, k_rows=True), d, 1),
        "hm+kr": (DecodeTiles(head_major=True, k_rows=True), d, 1),
    }
    for bn, w, st in [(32, 4, 2), (128, 4, 2), (128, 8, 2), (64, 4, 3), (64, 4, 4), (128, 8, 3), (64, 8, 3)]:
        out[f"hm+kr n{bn}w{w}s{st}"] = (DecodeTiles(bn, w, st, True, True), d, 1)
        out[f"n{bn}w{w}s{st}"] = (DecodeTiles(bn, w, st, False, False), d, 1)
    for factor, tokens in [(2, 256), (4, 256), (4, 512), (8, 128)]:
        out[f"hm+kr x{factor}/{tokens}"] = (DecodeTiles(head_major=True, k_rows=True), tokens, factor)
        out[f"x{factor}/{tokens}"] = (DecodeTiles(head_major=False, k_rows=False), tokens, factor)
    return out


def run_case(case: str, seq_lens: list[int], pools, copy_gbps: float, names: list[str] | None) -> list[dict]:
    bs = len(seq_lens)
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * 2
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    scale = HEAD_DIM**-0.5
    sms = device_facts()[1]
    base_splits = max_kv_splits_for(bs, KV_HEADS, sms)
    sets = []
    for pool in pools:
        k_buf, v_buf, table, rows = pool
        q = torch.randn((bs, HEADS * HEAD_DIM), device=DEV, dtype=DT)
        sets.append((q, k_buf, v_buf, table, rows, torch.empty_like(q)))
    q, k_buf, v_buf, table, rows, out = sets[0]
    expect = ref.decode_attention_ref(q, k_buf, v_buf, table, rows, lens, scale)
    results = []
    chosen = {name: v for name, v in variants().items() if names is None or name in names}
    for name, (tiles, min_tokens, factor) in progress_bar(chosen.items(), desc=f"{case} variants", total=len(chosen),
                                                          lines_when_piped=False, leave=False):
        max_splits = min(64, base_splits * factor)
        part_out, part_lse = alloc_decode_partials(bs, HEADS, max_splits, HEAD_DIM, DEV)
        counters = alloc_split_counters(bs, KV_HEADS, DEV)
        splits = kv_splits_per_request(lens, max_splits, min_tokens_per_split=min_tokens)

        def launch(s, splits=splits, tiles=tiles, max_splits=max_splits, po=part_out, pl=part_lse, c=counters):
            return decode_attention(
                s[0], s[1], s[2], s[5], s[3], s[4], lens, splits, max_splits, scale, po, pl, tiles, split_counters=c
            )

        try:
            out.fill_(float("nan"))
            launch(sets[0])
            err = rel_err(out, expect)
            ms = bench_ms(rotating([lambda s=s: launch(s) for s in sets]))
        except Exception as exc:  # a shape that does not compile is reported, not fatal
            say(f"  {case} {name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        results.append({"case": case, "variant": name, "us": ms * 1e3, "gbps": gbps,
                        "ratio": gbps / copy_gbps, "err": err, "max_splits": max_splits})  # fmt: skip
        say(f"  {case:<16} {name:<22} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s {gbps / copy_gbps:6.3f}  err {err:.1e}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="gpu_decode_sweep.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_gbps, _ = measure_ceilings()
    name, sms, l2 = device_facts()
    print(f"device {name}, {sms} SMs; copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    rng = random.Random(0)
    prompts = [rng.randint(100, 1024) for _ in range(256)]
    p3_lens = [p + rng.randint(0, 1024) for p in prompts]
    kv_bytes = sum(p3_lens) * KV_HEADS * HEAD_DIM * 4
    n = copies_for(kv_bytes)
    results = []
    results += run_case("p3 bs256", p3_lens, [p3_pool(p3_lens, prompts) for _ in range(n)], copy_gbps, None)
    results += run_case("p3 bs256 shuffled", p3_lens, [paged_pool(p3_lens, KV_HEADS, HEAD_DIM) for _ in range(n)],
                        copy_gbps, None)  # fmt: skip
    best = sorted((r for r in results if r["case"] == "p3 bs256" and r["err"] < 1e-2), key=lambda r: r["us"])[:4]
    keep = ["default", "old", "head_major", "k_rows", "hm+kr"] + [r["variant"] for r in best]
    mixed = [rng.randint(1024, 4096) for _ in range(64)]
    for case, lens in [("bs64 1k-4k", mixed), ("bs32 2k", [2048] * 32), ("bs1 4k", [4096]), ("bs1 32k", [32768])]:
        b = sum(lens) * KV_HEADS * HEAD_DIM * 4
        pools = [paged_pool(lens, KV_HEADS, HEAD_DIM) for _ in range(copies_for(b))]
        results += run_case(case, lens, pools, copy_gbps, keep)
    print(f"\n{'case':<18}{'variant':<24}{'us':>9}{'of copy bw':>12}")
    for case in dict.fromkeys(r["case"] for r in results):
        rows = sorted((r for r in results if r["case"] == case), key=lambda r: r["us"])
        default = next((r for r in rows if r["variant"] == "default"), None)
        for r in rows[:3] + ([default] if default and default not in rows[:3] else []):
            print(f"{case:<18}{r['variant']:<24}{r['us']:9.1f}{r['ratio']:12.3f}")
    (OUT / args.json).write_text(json.dumps({"copy_gbps": copy_gbps, "rows": results}, indent=1))
    return 0 if all(r["err"] < 1e-2 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
