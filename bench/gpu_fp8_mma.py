"""Check and time kernels/fp8_gemv_mma.py (block-FP8 decode products on the FP8 tensor cores, the rows
quantized per 128-column group in the kernel) against kernels/fp8_gemv.py's weight-only GEMV, at the
linear shapes of a Qwen3-8B decode step, on one GPU.

    python bench/gpu_fp8_mma.py [--quick]      (repository root; bench/gpu_session.sh fp8mma)

Checks (relative error against kernels/fp8_reference.py in float32 on the same quantized operands,
held to 1e-2; bits where the same bits are owed): M = 1, 3 and 16 rows at two shapes (one with N not a
multiple of the tile), with and without the split over K; the same launch three times (the split's
ticketed reduction adds in a fixed order: identical bits); a CUDA-graph replay against the eager call;
both fused prologues against the unfused kernels then the product (identical bits).
Timing, every figure a CUDA-graph replay over 36 layers' distinct weights (past L2): per shape the tile
sweep, the default tiles, the weight-only one-row GEMV, the weight-only dot form at 16 rows against
the tensor-core form at 16, each against the fp8 byte ceiling (weight + scale bytes / copy bandwidth
measured in this run); the whole step's 144 products; the 8B and 0.6B steps' three fused-prologue
products (add-RMSNorm -> qkv, add-RMSNorm -> gate_up, SiLU-and-mul -> down), weight-only against mma.
JSON to $OUT/gpu_fp8_mma.json; a table closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402
from bench.gpu_common import SHAPES as MODELS  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8_gemv import fp8_block_gemv, fp8_rmsnorm_gemv, fp8_silu_mul_gemv  # noqa: E402
from kernels.fp8_gemv_mma import (  # noqa: E402
    DEFAULT_MMA_TILES,
    MmaGemvTiles,
    fp8_mma_gemv,
    fp8_mma_rmsnorm_gemv,
    fp8_mma_silu_mul_gemv,
)
from kernels.fp8_reference import (  # noqa: E402
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
    w8a8_block_fp8_matmul_reference,
)
from kernels.gemv import GemvTiles  # noqa: E402
from kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402

BLOCK = (128, 128)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 36
TOL = 1e-2
SWEEP = (
    [
        MmaGemvTiles(bn, p, 4, st, u)
        for bn in (64, 128)
        for p in (264, 528)
        for st in (2, 3)
        for u in (1, 2, 4)
    ]
    + [MmaGemvTiles(128, 528, 8, 3, 2), MmaGemvTiles(256, 264, 8, 2, 1), MmaGemvTiles(256, 264, 8, 2, 2)]
    + [MmaGemvTiles(bn, p, 4, st, 1, True) for bn in (64, 128) for p in (264, 528, 1056) for st in (3, 4)]
)
DOT16 = GemvTiles(32, 128, 4, 4, "dot")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else float((out - ref).norm() / ref.norm())


def graph_us(fn: Callable[[], object], calls: int = 1) -> float:
    return cuda_graph_seconds(fn, reps=7) / calls * 1e6


def random_fp8(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_block_weight(torch.randn(n, k, device=dev) * 0.02, BLOCK)


def w8a8_reference(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    a_q, a_s = per_token_group_quant_fp8_reference(x, BLOCK[1])
    return w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, BLOCK)


def check(results: dict[str, float], dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    for n, k in [(6144, 4096), (1000, 768)]:
        w_q, w_s = random_fp8(n, k, dev)
        for m in (1, 3, 16):
            x = (torch.randn(m, k, device=dev, generator=g) * 3).bfloat16()
            ref = w8a8_reference(x, w_q, w_s)
            results[f"mma {m}x{n}x{k}"] = rel_err(fp8_mma_gemv(x, w_q, w_s, BLOCK), ref)
            results[f"mma {m}x{n}x{k} unsplit"] = rel_err(
                fp8_mma_gemv(x, w_q, w_s, BLOCK, MmaGemvTiles(programs=1)), ref
            )
            runs = [fp8_mma_gemv(x, w_q, w_s, BLOCK) for _ in range(3)]
            results[f"mma {m}x{n}x{k} repeat bits differ"] = float(
                sum(int(not torch.equal(runs[0], r)) for r in runs)
            )
        x = torch.randn(1, k, device=dev).bfloat16()
        eager = fp8_mma_gemv(x, w_q, w_s, BLOCK)
        graph, out = torch.cuda.CUDAGraph(), None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_mma_gemv(x, w_q, w_s, BLOCK)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = fp8_mma_gemv(x, w_q, w_s, BLOCK)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        results[f"mma graph replay vs eager {n}x{k} bits differ"] = float(not torch.equal(out, eager))
    hidden, inter = 4096, 12288
    (wq, ws), (dq, ds) = random_fp8(6144, hidden, dev), random_fp8(hidden, inter, dev)
    h, r = (torch.randn(1, hidden, device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm = (1 + 0.1 * torch.randn(hidden, device=dev)).bfloat16()
    y, res = fp8_mma_rmsnorm_gemv(h, r, norm, 1e-6, wq, ws, BLOCK)
    x, res_ref = fused_add_rmsnorm(h, r, norm, 1e-6)
    results["mma rmsnorm prologue vs separate, bits differ"] = float(
        not (torch.equal(y, fp8_mma_gemv(x, wq, ws, BLOCK)) and torch.equal(res, res_ref))
    )
    gu = torch.randn(1, 2 * inter, device=dev, dtype=torch.bfloat16)
    results["mma silu prologue vs separate, bits differ"] = float(
        not torch.equal(
            fp8_mma_silu_mul_gemv(gu, dq, ds, BLOCK), fp8_mma_gemv(silu_and_mul(gu), dq, ds, BLOCK)
        )
    )


def shape_row(
    name: str, n: int, k: int, dev: torch.device, copy_bw: float, sweep: list[MmaGemvTiles]
) -> dict:
    ws = [random_fp8(n, k, dev) for _ in range(LAYERS)]
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    ceiling = (n * k + ws[0][1].numel() * 4) / copy_bw * 1e6

    def mma(tiles: MmaGemvTiles, x: torch.Tensor = x1) -> float:
        return graph_us(lambda: [fp8_mma_gemv(x, q, s, BLOCK, tiles) for q, s in ws], LAYERS)

    timed = []
    for tiles in sweep:
        try:
            timed.append((mma(tiles), tiles))
        except Exception as exc:  # a tile the compiler rejects: said, skipped
            print(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    best_us, best = min(timed, key=lambda t: t[0])
    row = {
        "table": "shape", "shape": name, "n": n, "k": k, "ceiling_us": ceiling, "mma_default_us": mma(DEFAULT_MMA_TILES),
        "mma_best_us": best_us, "mma_best_tiles": best.__dict__,
        "rows_gemv_us": graph_us(lambda: [fp8_block_gemv(x1, q, s, BLOCK) for q, s in ws], LAYERS),
        "mma16_us": mma(DEFAULT_MMA_TILES, x16),
        "dot16_us": graph_us(lambda: [fp8_block_gemv(x16, q, s, BLOCK, DOT16) for q, s in ws], LAYERS),
        "sweep": [(t, tl.__dict__) for t, tl in timed],
    }  # fmt: skip
    print(f"{name}: mma default {row['mma_default_us']:.1f} best {best_us:.1f} us ({best}), weight-only "
          f"{row['rows_gemv_us']:.1f}, ceiling {ceiling:.1f}; 16 rows mma {row['mma16_us']:.1f} dot "
          f"{row['dot16_us']:.1f}", flush=True)  # fmt: skip
    return row


def time_shapes(rows: list[dict], dev: torch.device, copy_bw: float, sweep: list[MmaGemvTiles]) -> dict:
    """Per shape, the tile sweep and the references; returns the best tiles per shape."""
    best = {}
    for name, (n, k) in SHAPES.items():
        rows.append(shape_row(name, n, k, dev, copy_bw, sweep))
        best[name] = MmaGemvTiles(**rows[-1]["mma_best_tiles"])
        torch.cuda.empty_cache()
    return best


def time_step(
    rows: list[dict], dev: torch.device, copy_bw: float, best: dict, best_case: str = "mma, best tiles"
) -> None:
    ws = {name: [random_fp8(n, k, dev) for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    xs = {name: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    nbytes = sum(q.numel() + s.numel() * 4 for v in ws.values() for q, s in v)
    ceiling_ms = nbytes / copy_bw * 1e3
    cases: dict[str, Callable[[str, int], object]] = {
        "weight-only gemv": lambda nm, i: fp8_block_gemv(xs[nm], *ws[nm][i], BLOCK),
        "mma, default tiles": lambda nm, i: fp8_mma_gemv(xs[nm], *ws[nm][i], BLOCK),
        best_case: lambda nm, i: fp8_mma_gemv(xs[nm], *ws[nm][i], BLOCK, best[nm]),
    }
    for case, fn in cases.items():
        ms = graph_us(lambda fn=fn: [fn(nm, i) for i in range(LAYERS) for nm in SHAPES]) / 1e3
        rows.append(
            {"table": "step", "case": case, "ms": ms, "ceiling_ms": ceiling_ms, "of_ceiling": ceiling_ms / ms}
        )
        print(
            f"step of 144, {case}: {ms:.3f} ms, ceiling {ceiling_ms:.3f} -> {ceiling_ms / ms:.3f}", flush=True
        )
    ws.clear()
    torch.cuda.empty_cache()


def prologue_case(model: str, dev: torch.device, copy_bw: float) -> dict:
    s = MODELS[model]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    w = {name: [random_fp8(n, k, dev) for _ in range(layers)]
         for name, (n, k) in {"qkv": (qkv, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items()}  # fmt: skip
    norm = (1 + 0.1 * torch.randn(hidden, device=dev)).bfloat16()
    h, r, gu = (torch.randn(1, n, device=dev, dtype=torch.bfloat16) for n in (hidden, hidden, 2 * inter))

    def weight_only(i: int) -> None:
        _, res = fp8_rmsnorm_gemv(h, r, norm, 1e-6, *w["qkv"][i], BLOCK)
        fp8_rmsnorm_gemv(h, res, norm, 1e-6, *w["gate_up"][i], BLOCK)
        fp8_silu_mul_gemv(gu, *w["down"][i], BLOCK)

    def mma(i: int) -> None:
        _, res = fp8_mma_rmsnorm_gemv(h, r, norm, 1e-6, *w["qkv"][i], BLOCK)
        fp8_mma_rmsnorm_gemv(h, res, norm, 1e-6, *w["gate_up"][i], BLOCK)
        fp8_mma_silu_mul_gemv(gu, *w["down"][i], BLOCK)

    nbytes = sum(q.numel() + sc.numel() * 4 for v in w.values() for q, sc in v)
    row = {"table": "prologue", "model": model, "ceiling_ms": nbytes / copy_bw * 1e3}
    for form, fn in (("weight_only", weight_only), ("mma", mma)):
        row[f"{form}_ms"] = graph_us(lambda fn=fn: [fn(i) for i in range(layers)]) / 1e3
    print(f"prologues {model}: weight-only {row['weight_only_ms']:.3f} ms, mma {row['mma_ms']:.3f} ms, "
          f"ceiling {row['ceiling_ms']:.3f} ms", flush=True)  # fmt: skip
    return row


def step_only() -> int:
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth()
    rows: list[dict] = []
    stages3 = MmaGemvTiles(num_stages=3)
    time_step(rows, dev, copy_bw, {name: stages3 for name in SHAPES}, "mma, three copies in flight")
    for model in ("8b", "0.6b"):
        rows.append(prologue_case(model, dev, copy_bw))
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    tag = "_".join(f"{k}{os.environ[k]}" for k in ("RS_PDL", "RS_PDL_PRELOAD") if k in os.environ)
    (OUT / f"gpu_fp8_mma_step{'_' + tag if tag else ''}.json").write_text(
        json.dumps({"copy_bw": copy_bw, "rows": rows}, indent=1)
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller tile sweep")
    parser.add_argument("--step-only", action="store_true",
                        help="no checks and no sweep: the step of 144 with the default tiles and with three "
                             "copies in flight, and the fused-prologue steps (for A/B runs of a switch)")  # fmt: skip
    args = parser.parse_args()
    if args.step_only:
        return step_only()
    dev = torch.device("cuda")
    copy_bw = copy_bandwidth()
    checks: dict[str, float] = {}
    try:
        check(checks, dev)
    except Exception as exc:  # report it, and still time
        print(f"checks raised {type(exc).__name__}: {exc}"[:800], flush=True)
        checks["checks raised"] = float("inf")
    print("checks done", flush=True)
    rows: list[dict] = []
    sweep = [t for t in SWEEP if t.num_stages == 3] if args.quick else SWEEP
    best = time_shapes(rows, dev, copy_bw, sweep)
    time_step(rows, dev, copy_bw, best)
    for model in ("8b", "0.6b"):
        rows.append(prologue_case(model, dev, copy_bw))
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_fp8_mma.json").write_text(
        json.dumps({"copy_bw": copy_bw, "checks": checks, "rows": rows}, indent=1)
    )
    print(f"\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s")
    for name, err in checks.items():
        print(f"{name:<56} {err:10.2e}{'' if err < TOL else '  FAIL'}")
    print(f"\n{'shape':<9}{'ceiling':>9}{'mma def':>9}{'mma best':>9}{'of ceil':>8}{'w-only':>8}{'of ceil':>8}"
          f"{'mma16':>8}{'dot16':>8}  (us; best tiles)")  # fmt: skip
    for r in (r for r in rows if r["table"] == "shape"):
        print(f"{r['shape']:<9}{r['ceiling_us']:9.1f}{r['mma_default_us']:9.1f}{r['mma_best_us']:9.1f}"
              f"{r['ceiling_us'] / r['mma_best_us']:8.2f}{r['rows_gemv_us']:8.1f}{r['ceiling_us'] / r['rows_gemv_us']:8.2f}"
              f"{r['mma16_us']:8.1f}{r['dot16_us']:8.1f}  {tuple(r['mma_best_tiles'].values())}")  # fmt: skip
    for r in (r for r in rows if r["table"] == "step"):
        print(
            f"step of 144, {r['case']}: {r['ms']:.3f} ms = {r['of_ceiling']:.3f} of the ceiling (goal >= 0.85)"
        )
    for r in (r for r in rows if r["table"] == "prologue"):
        print(f"{r['model']} fused-prologue products: weight-only {r['weight_only_ms']:.3f} ms "
              f"({r['ceiling_ms'] / r['weight_only_ms']:.3f}), mma {r['mma_ms']:.3f} ms ({r['ceiling_ms'] / r['mma_ms']:.3f})")  # fmt: skip
    failed = [n for n, e in checks.items() if not e < TOL]
    print(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
