"""The FP8 block-scaled products at batched-decode sizes (M = 33-256 rows): every linear shape of a
Qwen3-8B layer against cuBLAS bf16 on the same (dequantized) weights, to choose fp8_tiles_for's tiles.

    python bench/gpu_fp8_rows.py [--ms 64,96,128,192,256] [--quick]

Rows: cuBLAS bf16; the quantizer alone; fp8_block_linear as it dispatches (its default tiles); and
per_token_group_quant_fp8 + w8a8_block_fp8_matmul over a tile sweep that includes split-K (the sum of
both launches). (A weight-only form, bf16 rows times each weight tile converted to bf16 on the CUDA
cores, was 1.3-2.5x slower than w8a8 at every size here on an H100, 2026-12-06, and is not kept.) Every
time is a CUDA-graph replay of one product per weight copy over enough copies (> 200 MB of weights) that
each one is read from HBM, not L2, as in a decode step; per product. Each swept launch is checked first
against the float32 product of the quantized rows and their scales (relative error < 1e-2), and
fp8_block_linear too. JSON to $OUT/gpu_fp8_rows.json; the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402
from kernels.fp8_gemm import (  # noqa: E402
    Fp8Tiles,
    fp8_block_linear,
    fp8_tiles_for,
    per_token_group_quant_fp8,
    sm_count,
    w8a8_block_fp8_matmul,
)
from kernels.fp8_reference import (  # noqa: E402
    dequantize_block_weight,
    quantize_block_weight,
    w8a8_block_fp8_matmul_reference,
)
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402

BLOCK = (128, 128)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# (block_m, block_n, block_k, group_m, num_warps, num_stages, split_k)
SWEEP = [Fp8Tiles(*t) for t in [
    (64, 64, 128, 8, 4, 4, 1), (64, 128, 128, 8, 4, 3, 1), (64, 32, 128, 8, 4, 4, 1),
    (128, 64, 128, 1, 8, 3, 1), (128, 64, 128, 1, 4, 3, 1), (128, 128, 128, 1, 8, 3, 1), (128, 32, 128, 1, 4, 4, 1),
    (64, 64, 128, 8, 4, 4, 2), (64, 64, 128, 8, 4, 4, 4), (64, 32, 128, 8, 4, 4, 2),
    (128, 64, 128, 1, 8, 3, 2), (128, 64, 128, 1, 4, 3, 2), (128, 32, 128, 1, 4, 4, 2), (128, 64, 128, 1, 8, 3, 4),
    (32, 64, 128, 4, 4, 4, 1), (32, 64, 128, 4, 4, 4, 2),
]]  # fmt: skip
QUICK = SWEEP[:2] + SWEEP[3:5] + SWEEP[7:8] + SWEEP[10:12]
HBM_BYTES = 200 << 20


def tiles_dict(t: Fp8Tiles) -> dict:
    return dict(t.__dict__)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def time_shape(
    m: int,
    name: str,
    x: torch.Tensor,
    w_deq: torch.Tensor,
    fp8: list[tuple[torch.Tensor, torch.Tensor]],
    bf16: list[torch.Tensor],
    sweep: list[Fp8Tiles],
    failed: list[str],
) -> dict:
    """One (m, shape) row: bf16, the quantizer, fp8_block_linear as it dispatches, and both forms' sweeps."""
    n, k = w_deq.shape
    copies = len(fp8)
    wq, ws = fp8[0]
    row: dict = {"m": m, "shape": name, "n": n, "k": k, "copies": copies, "fp8_bytes": n * k + ws.numel() * 4}
    row["bf16_us"] = (
        cuda_graph_seconds(lambda: [torch.nn.functional.linear(x, w) for w in bf16]) / len(bf16) * 1e6
    )
    row["quant_us"] = (
        cuda_graph_seconds(lambda: [per_token_group_quant_fp8(x, 128) for _ in fp8]) / copies * 1e6
    )
    row["linear_us"] = (
        cuda_graph_seconds(lambda: [fp8_block_linear(x, q, s, BLOCK) for q, s in fp8]) / copies * 1e6
    )
    row["default_tiles"] = tiles_dict(fp8_tiles_for(m, n, sm_count(x.device)))
    a_q, a_s = per_token_group_quant_fp8(x, 128)
    ref_w8a8 = w8a8_block_fp8_matmul_reference(a_q, a_s, wq, ws, BLOCK)
    timed = []
    for t in sweep:

        def fn(t: Fp8Tiles = t) -> list:
            return [
                w8a8_block_fp8_matmul(*per_token_group_quant_fp8(x, 128), q, s, BLOCK, tiles=t)
                for q, s in fp8
            ]

        err = rel(w8a8_block_fp8_matmul(a_q, a_s, wq, ws, BLOCK, tiles=t), ref_w8a8)
        if not err < 1e-2:
            failed.append(f"m={m} {name} {t}: {err:.2e}")
            print("FAILED:", failed[-1], flush=True)
            continue
        timed.append((cuda_graph_seconds(fn) / copies * 1e6, t, err))
    timed.sort(key=lambda r: r[0])
    row["sweep"] = [{"us": us, "tiles": tiles_dict(t), "rel_err": e} for us, t, e in timed]
    row["best_us"], row["best_tiles"] = timed[0][0], tiles_dict(timed[0][1])
    row["linear_rel_err"] = rel(fp8_block_linear(x, wq, ws, BLOCK), ref_w8a8)
    if not row["linear_rel_err"] < 1e-2:
        failed.append(f"fp8_block_linear m={m} {name}: {row['linear_rel_err']:.2e}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,96,128,192,256")
    ap.add_argument("--quick", action="store_true", help="a smaller tile sweep")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    sweep = QUICK if args.quick else SWEEP
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    copy_bw = copy_bandwidth()
    torch.manual_seed(0)
    rows: list[dict] = []
    failed: list[str] = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-HBM_BYTES // (n * k)))
        wq, ws = quantize_block_weight(torch.randn(n, k, device=dev) * 0.02, BLOCK)
        w_deq = dequantize_block_weight(wq, ws, BLOCK)
        fp8 = [(wq.clone(), ws.clone()) for _ in range(copies)]
        bf16 = [w_deq.bfloat16() for _ in range(max(2, -(-HBM_BYTES // (2 * n * k))))]
        for m in ms:
            row = time_shape(
                m, name, torch.randn(m, k, device=dev).bfloat16(), w_deq, fp8, bf16, sweep, failed
            )
            rows.append(row)
            print(f"m={m:<4}{name:<8} bf16 {row['bf16_us']:7.1f}  quant {row['quant_us']:5.1f}  linear {row['linear_us']:7.1f}"
                  f" {tuple(row['default_tiles'].values())}  best {row['best_us']:7.1f} {tuple(row['best_tiles'].values())}",
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        fp8.clear()
        bf16.clear()
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_fp8_rows.json").write_text(
        json.dumps({"copy_bw": copy_bw, "rows": rows, "failed": failed}, indent=1)
    )
    print(f"\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s; per product, us (fp8 ceiling: weight bytes / copy bw)")
    print(f"{'m':>4} {'shape':<8}{'bf16':>8}{'ceiling':>8}{'quant':>7}{'linear':>8}{'best':>8}")
    for r in rows:
        print(f"{r['m']:>4} {r['shape']:<8}{r['bf16_us']:8.1f}{r['fp8_bytes'] / copy_bw * 1e6:8.1f}{r['quant_us']:7.1f}"
              f"{r['linear_us']:8.1f}{r['best_us']:8.1f}")  # fmt: skip
    # The best single tile per form and m over the four shapes (a layer's sum).
    print(
        "\nper m, the layer's four products summed: bf16, fp8_block_linear, the best single tile for all four (us)"
    )
    for m in ms:
        mr = [r for r in rows if r["m"] == m]
        line = f"m={m:<4} bf16 {sum(r['bf16_us'] for r in mr):7.1f}  linear {sum(r['linear_us'] for r in mr):7.1f}"
        totals: dict[tuple, float] = {}
        for r in mr:
            for e in r["sweep"]:
                key = tuple(e["tiles"].values())
                totals[key] = totals.get(key, 0.0) + e["us"]
        full = {key: v for key, v in totals.items() if all(
            any(tuple(e["tiles"].values()) == key for e in r["sweep"]) for r in mr)}  # fmt: skip
        best = min(full, key=full.get)
        line += f"  one tile for all {full[best]:7.1f} {best}"
        print(line)
    if failed:
        print("FAILED:", *failed, sep="\n  ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
