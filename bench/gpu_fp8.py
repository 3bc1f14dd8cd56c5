"""Check and time the block-wise FP8 kernels (kernels/fp8_gemm.py, kernels/fp8_gemv.py, kernels/fused_moe.py's
FP8 experts) on one GPU, with 128 x 128 blocks as Qwen3-FP8 publishes them.

    python bench/gpu_fp8.py [--quick]      (from the repository root; needs torch + triton, a GPU)

Correctness first, against kernels/fp8_reference.py in float32 on the same inputs: the activation
quantizer bit for bit against torch's own e4m3 cast (share of differing bytes), the w8a8 GEMM against the
dequantized product, the weight-only GEMV (one row and 3 / 16 rows) and fp8_block_linear against the
dequantized linear, the fused MoE in both forms against its reference; odd shapes included (N, K not
multiples of 128). Then timing, every figure a CUDA-graph replay (no host launch cost):
- batch-1 GEMV at Qwen3-8B's linear shapes (qkv 4096->6144, o 4096->4096, gate_up 4096->24576,
  down 12288->4096), 36 layers' distinct weights per replay (far past L2): fp8 rows tiles (default and
  the best of a sweep), the fp8 dot form, kernels/gemv.py on bf16, cuBLAS bf16, each against the fp8 byte
  ceiling (weight + scale bytes / the copy bandwidth measured in this run); then the whole step's 144
  products, fp8 (default and best tiles) and bf16 GEMV, against the ceiling (goal >= 0.85 for fp8).
- the fused prologues at batch 1, Qwen3-8B and 0.6B shapes: per layer add-RMSNorm -> qkv, add-RMSNorm ->
  gate_up, SiLU-and-mul -> down, as separate kernels + fp8_block_gemv against fp8_rmsnorm_gemv /
  fp8_silu_mul_gemv (one launch each), every layer's own weights, against those weights' byte ceiling.
- GEMM at M = 256 and 4096 on the same shapes: fp8_block_linear (quantize + w8a8), w8a8 alone (the best
  of a small tile sweep too) and torch.matmul bf16.
- fused MoE at Qwen3-30B-A3B's expert shape (128 experts, hidden 2048, intermediate 768, top-8) at
  T = 1, 64, 1024: bf16, FP8 weight-only, FP8 w8a8 (which one fused_moe picks by default is marked); T = 1
  against the bytes of the 8 experts it reads.
JSON to $OUT/gpu_fp8.json; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import triton

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402
from bench.gpu_common import SHAPES as MODELS  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8_gemm import (  # noqa: E402
    Fp8Tiles,
    fp8_block_gemv,
    fp8_block_linear,
    fp8_tiles_for,
    per_token_group_quant_fp8,
    w8a8_block_fp8_matmul,
)
from kernels.fp8_gemv import fp8_rmsnorm_gemv, fp8_silu_mul_gemv  # noqa: E402
from kernels.fp8_reference import (  # noqa: E402
    dequantize_block_weight,
    fp8_block_linear_reference,
    fused_moe_fp8_reference,
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
    w8a8_block_fp8_matmul_reference,
)
from kernels.fused_moe import fused_moe  # noqa: E402
from kernels.gemv import GemvTiles, gemv  # noqa: E402
from kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402

BLOCK = (128, 128)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 36
MOE = dict(experts=128, hidden=2048, inter=768, top_k=8)
TOL = 1e-2  # bf16 outputs against float32 references of the same quantized operands
ROWS_SWEEP = [
    GemvTiles(bn, bk, w, st)
    for bn, bk, w, st in [(8, 1024, 4, 3), (16, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 4, 3), (16, 1024, 8, 3),
                          (32, 512, 8, 3), (32, 256, 8, 1), (64, 256, 8, 3), (16, 2048, 8, 2), (8, 2048, 8, 2)]
]  # fmt: skip
DOT_AT_ONE = GemvTiles(32, 128, 4, 4, "dot")
W8A8_SWEEP = [Fp8Tiles(64, 128, 128, 8, 4, 3), Fp8Tiles(128, 128, 128, 8, 8, 3), Fp8Tiles(64, 64, 128, 8, 4, 4),
              Fp8Tiles(128, 256, 128, 8, 8, 3), Fp8Tiles(64, 128, 128, 8, 4, 4)]  # fmt: skip
# Batched decode (17-128 rows): narrower N for more programs over the weight, 16-64 row blocks.
SMALL_M_SWEEP = [Fp8Tiles(16, 64, 128, 1, 4, 4), Fp8Tiles(32, 64, 128, 4, 4, 4), Fp8Tiles(32, 128, 128, 4, 4, 3),
                 Fp8Tiles(64, 64, 128, 8, 4, 4), Fp8Tiles(64, 128, 128, 8, 4, 4), Fp8Tiles(64, 32, 128, 8, 4, 4),
                 Fp8Tiles(32, 32, 128, 4, 4, 4), Fp8Tiles(16, 128, 128, 1, 4, 3)]  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else float((out - ref).norm() / ref.norm())


def graph_us(fn: Callable[[], object], calls: int = 1) -> float:
    """Microseconds per call of fn (which makes `calls` calls), replayed from a CUDA graph."""
    return cuda_graph_seconds(fn, reps=7) / calls * 1e6


def random_fp8(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A blockwise-quantized random weight (as a checkpoint stores it) of scale ~0.02."""
    return quantize_block_weight(torch.randn(n, k, device=dev) * 0.02, BLOCK)


def check(results: dict[str, float], dev: torch.device, quick_shapes: bool = False) -> None:
    """Errors of every kernel against its float32 reference, into results (name -> rel err)."""
    g = torch.Generator(device=dev).manual_seed(0)
    for m, k in [(777, 4096), (5, 1000)]:
        x = (
            torch.randn(m, k, device=dev, generator=g) * torch.rand(m, 1, device=dev, generator=g) * 10
        ).bfloat16()
        q, s = per_token_group_quant_fp8(x, 128)
        q_ref, s_ref = per_token_group_quant_fp8_reference(x, 128)
        results[f"quant {m}x{k}: share of bytes != torch cast"] = (
            (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()
        )
        results[f"quant {m}x{k}: scale rel err"] = rel_err(s, s_ref)
    shapes = [(6144, 4096), (1000, 700)] if not quick_shapes else [(100, 300)]
    for n, k in shapes:
        w_q, w_s = random_fp8(n, k, dev)
        for m in (1, 3, 16, 17, 256):
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            ref = fp8_block_linear_reference(x.float(), w_q, w_s, BLOCK)
            if m <= 16:
                results[f"gemv {m}x{n}x{k}"] = rel_err(fp8_block_gemv(x, w_q, w_s, BLOCK), ref)
                if m == 1:
                    results[f"gemv dot-form 1x{n}x{k}"] = rel_err(
                        fp8_block_gemv(x, w_q, w_s, BLOCK, DOT_AT_ONE), ref
                    )
            else:
                a_q, a_s = per_token_group_quant_fp8(x, 128)
                exact = w8a8_block_fp8_matmul_reference(a_q, a_s, w_q, w_s, BLOCK)
                results[f"w8a8 {m}x{n}x{k}"] = rel_err(
                    w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, BLOCK), exact
                )
                # Not held to TOL: e4m3's rounding of the activations (informational).
                results[f"linear {m}x{n}x{k} vs unquantized x (info)"] = rel_err(
                    fp8_block_linear(x, w_q, w_s, BLOCK), ref
                )
    e, h, i, top_k = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["top_k"]
    if quick_shapes:
        e, h, i, top_k = 8, 256, 192, 2
    w13, w13_s = quantize_block_weight(torch.randn(e, 2 * i, h, device=dev) * 0.02, BLOCK)
    w2, w2_s = quantize_block_weight(torch.randn(e, h, i, device=dev) * 0.02, BLOCK)
    for t in (1, 64, 300):
        x = torch.randn(t, h, device=dev, generator=g).bfloat16()
        weights, ids = routing(t, e, top_k, dev, g)
        for quantize in (False, True):
            out = fused_moe(
                x,
                w13,
                w2,
                weights,
                ids,
                w13_scale_inv=w13_s,
                w2_scale_inv=w2_s,
                block_size=BLOCK,
                fp8_activations=quantize,
            )
            ref = fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, BLOCK, weights, ids, quantize)
            results[f"moe T={t} {'w8a8' if quantize else 'weight-only'}"] = rel_err(out, ref)


def routing(t: int, e: int, top_k: int, dev: torch.device, g: torch.Generator | None = None):
    logits = torch.randn(t, e, device=dev, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids


def time_gemv(
    rows: list[dict], dev: torch.device, copy_bw: float, sweep: list[GemvTiles]
) -> dict[str, GemvTiles]:
    """Batch-1 products per shape; returns the best fp8 rows tiles per shape."""
    best: dict[str, GemvTiles] = {}
    for name, (n, k) in SHAPES.items():
        fp8 = [(torch.randn(n, k, device=dev) * 0.3).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
        scales = [
            torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev) * 1e-3 for _ in range(LAYERS)
        ]
        bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)

        def fp8_pass(tiles, fp8=fp8, scales=scales, x=x):
            return lambda: [fp8_block_gemv(x, w, s, BLOCK, tiles) for w, s in zip(fp8, scales)]

        ceiling_us = (n * k + scales[0].numel() * 4) / copy_bw * 1e6
        timed = []
        for tiles in sweep:
            try:
                timed.append((graph_us(fp8_pass(tiles), LAYERS), tiles))
            except Exception as exc:  # a tile the compiler rejects (registers, shared memory): said, skipped
                print(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        best_us, best[name] = min(timed, key=lambda item: item[0])
        row = {
            "table": "gemv", "shape": name, "n": n, "k": k, "ceiling_us": ceiling_us,
            "fp8_default_us": graph_us(fp8_pass(None), LAYERS), "fp8_best_us": best_us,
            "fp8_best_tiles": best[name].__dict__, "fp8_dot_us": graph_us(fp8_pass(DOT_AT_ONE), LAYERS),
            "bf16_gemv_us": graph_us(lambda bf16=bf16, x=x, out=out: [gemv(x, w, out=out) for w in bf16], LAYERS),
            "bf16_cublas_us": graph_us(lambda bf16=bf16, x=x, out=out: [torch.mm(x, w.t(), out=out) for w in bf16], LAYERS),
            "sweep": [(t, tl.__dict__) for t, tl in timed],
        }  # fmt: skip
        rows.append(row)
        print(
            f"gemv {name}: fp8 default {row['fp8_default_us']:.1f} us, best {best_us:.1f} us ({best[name]}), "
            f"ceiling {ceiling_us:.1f} us, bf16 gemv {row['bf16_gemv_us']:.1f} us",
            flush=True,
        )
        del fp8, scales, bf16
    return best


def time_step(rows: list[dict], dev: torch.device, copy_bw: float, best: dict[str, GemvTiles]) -> None:
    """One decode step's 144 linear products (36 layers x 4), each layer with its own weights."""
    fp8 = {name: [(torch.randn(n, k, device=dev) * 0.3).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
           for name, (n, k) in SHAPES.items()}  # fmt: skip
    scales = {name: [torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev) * 1e-3 for _ in range(LAYERS)]
              for name, (n, k) in SHAPES.items()}  # fmt: skip
    xs = {name: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    nbytes = sum(n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4 for n, k in SHAPES.values()) * LAYERS
    ceiling_ms = nbytes / copy_bw * 1e3

    def step(tiles: dict[str, GemvTiles | None]):
        def run():
            for layer in range(LAYERS):
                for name in SHAPES:
                    fp8_block_gemv(xs[name], fp8[name][layer], scales[name][layer], BLOCK, tiles[name])

        return run

    for label, tiles in (("default tiles", dict.fromkeys(SHAPES)), ("best tiles", best)):
        ms = graph_us(step(tiles)) / 1e3
        rows.append({"table": "step", "case": f"fp8 gemv, {label}", "ms": ms, "ceiling_ms": ceiling_ms,
                     "of_ceiling": ceiling_ms / ms, "bytes": nbytes})  # fmt: skip
        print(
            f"step fp8 ({label}): {ms:.3f} ms, ceiling {ceiling_ms:.3f} ms -> {ceiling_ms / ms:.3f}",
            flush=True,
        )


def prologue_case(model: str, checks: dict[str, float], dev: torch.device, copy_bw: float) -> dict:
    """A decode step's three products with a prologue, separate (norm / activation kernel, then the FP8
    GEMV) and fused; fused against separate on layer 0 into checks."""
    s = MODELS[model]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    w = {name: [random_fp8(n, k, dev) for _ in range(layers)]
         for name, (n, k) in {"qkv": (qkv, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items()}  # fmt: skip
    norms = [(1 + 0.1 * torch.randn(hidden, device=dev)).bfloat16() for _ in range(2)]
    h, r, gu = (torch.randn(1, n, device=dev, dtype=torch.bfloat16) for n in (hidden, hidden, 2 * inter))

    def separate(i: int) -> list[torch.Tensor]:
        x, res = fused_add_rmsnorm(h, r, norms[0], 1e-6)
        x2, _ = fused_add_rmsnorm(h, res, norms[1], 1e-6)
        return [fp8_block_gemv(x, *w["qkv"][i], BLOCK), fp8_block_gemv(x2, *w["gate_up"][i], BLOCK),
                fp8_block_gemv(silu_and_mul(gu), *w["down"][i], BLOCK)]  # fmt: skip

    def fused(i: int) -> list[torch.Tensor]:
        y, res = fp8_rmsnorm_gemv(h, r, norms[0], 1e-6, *w["qkv"][i], BLOCK)
        y2, _ = fp8_rmsnorm_gemv(h, res, norms[1], 1e-6, *w["gate_up"][i], BLOCK)
        return [y, y2, fp8_silu_mul_gemv(gu, *w["down"][i], BLOCK)]

    for name, a, b in zip(("qkv", "gate_up", "down"), fused(0), separate(0)):
        checks[f"fused prologue {model} {name} vs separate"] = rel_err(a, b.float())
    nbytes = sum(q.numel() + sc.numel() * 4 for ws in w.values() for q, sc in ws)
    row = {"table": "prologue", "model": model, "ceiling_ms": nbytes / copy_bw * 1e3, "bytes": nbytes}
    for form, fn in (("separate", separate), ("fused", fused)):
        row[f"{form}_ms"] = graph_us(lambda fn=fn: [fn(i) for i in range(layers)]) / 1e3
    print(f"prologues {model}: separate {row['separate_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms, "
          f"ceiling {row['ceiling_ms']:.3f} ms", flush=True)  # fmt: skip
    return row


def gemm_case(m: int, name: str, dev: torch.device, sweep: list[Fp8Tiles], copies: int = 4) -> dict:
    """One GEMM shape at M rows; `copies` distinct weights per replay, so M = 256 reads them from HBM."""
    n, k = SHAPES[name]
    ws = [random_fp8(n, k, dev) for _ in range(copies)]
    wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    a_q, a_s = per_token_group_quant_fp8(x, 128)

    def w8a8(tiles: Fp8Tiles | None) -> Callable[[], object]:
        return lambda: [w8a8_block_fp8_matmul(a_q, a_s, w, s, BLOCK, tiles=tiles) for w, s in ws]

    row = {
        "table": "gemm", "m": m, "shape": name, "n": n, "k": k,
        "bf16_us": graph_us(lambda: [x @ w.t() for w in wb], copies),
        "fp8_linear_us": graph_us(lambda: [fp8_block_linear(x, w, s, BLOCK) for w, s in ws], copies),
        "w8a8_default_us": graph_us(w8a8(None), copies), "default_tiles": fp8_tiles_for(m).__dict__,
    }  # fmt: skip
    timed = [(row["w8a8_default_us"], fp8_tiles_for(m).__dict__)]
    for tiles in sweep:
        try:
            timed.append((graph_us(w8a8(tiles), copies), tiles.__dict__))
        except Exception as exc:  # a tile the compiler rejects: said, skipped
            print(f"  w8a8 {tiles}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    row["w8a8_best_us"], row["w8a8_best_tiles"] = min(timed, key=lambda item: item[0])
    row["sweep"] = timed
    row["bf16_tflops"] = 2 * m * n * k / row["bf16_us"] / 1e6
    row["w8a8_best_tflops"] = 2 * m * n * k / row["w8a8_best_us"] / 1e6
    print(f"gemm M={m} {name}: bf16 {row['bf16_us']:.1f} us, fp8 linear {row['fp8_linear_us']:.1f} us, "
          f"w8a8 {row['w8a8_default_us']:.1f} / best {row['w8a8_best_us']:.1f} us", flush=True)  # fmt: skip
    return row


def moe_case(t: int, dev: torch.device, copy_bw: float, fp8: list, bf16: list) -> dict:
    """One MoE batch of t tokens over the layers' experts in fp8 (both forms) and bf16."""
    e, h, i, top_k = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["top_k"]
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    weights, ids = routing(t, e, top_k, dev)
    experts_read = int(torch.unique(ids).numel())

    def fp8_moe(quantize: bool) -> Callable[[], object]:
        return lambda: [
            fused_moe(x, a, b, weights, ids, w13_scale_inv=s, w2_scale_inv=u, block_size=BLOCK,
                      fp8_activations=quantize)
            for (a, s), (b, u) in fp8
        ]  # fmt: skip

    row = {
        "table": "moe", "t": t, "experts_read": experts_read,
        "fp8_ceiling_us": experts_read * 3 * i * h / copy_bw * 1e6,
        "default_form": "w8a8",
        "bf16_us": graph_us(lambda: [fused_moe(x, a, b, weights, ids) for a, b in bf16], len(bf16)),
        "fp8_weight-only_us": graph_us(fp8_moe(False), len(fp8)),
        "fp8_w8a8_us": graph_us(fp8_moe(True), len(fp8)),
    }  # fmt: skip
    print(f"moe T={t}: bf16 {row['bf16_us']:.1f} us, fp8 weight-only {row['fp8_weight-only_us']:.1f} us, "
          f"fp8 w8a8 {row['fp8_w8a8_us']:.1f} us (default {row['default_form']})", flush=True)  # fmt: skip
    return row


def time_gemm_and_moe(
    rows: list[dict], dev: torch.device, copy_bw: float, sweep: list[Fp8Tiles], gemm_ms: tuple[int, ...] = (256, 4096)
) -> None:
    small = [tiles for tiles in SMALL_M_SWEEP if tiles not in sweep]  # the full sweep has two of them
    for m in gemm_ms:
        for name in SHAPES:
            rows.append(gemm_case(m, name, dev, sweep + (small if m <= 128 else [])))
            torch.cuda.empty_cache()
    e, h, i = MOE["experts"], MOE["hidden"], MOE["inter"]
    layers = 4  # 4 layers' experts per replay: T = 1 reads 8 experts x 4 layers (150 MB fp8), past L2
    fp8 = [(quantize_block_weight(torch.randn(e, 2 * i, h, device=dev) * 0.02, BLOCK),
            quantize_block_weight(torch.randn(e, h, i, device=dev) * 0.02, BLOCK)) for _ in range(layers)]  # fmt: skip
    bf16 = [(dequantize_block_weight(a, s, BLOCK).bfloat16(), dequantize_block_weight(b, u, BLOCK).bfloat16())
            for (a, s), (b, u) in fp8]  # fmt: skip
    for t in (1, 64, 1024):
        rows.append(moe_case(t, dev, copy_bw, fp8, bf16))


def print_table(copy_bw: float, checks: dict[str, float], rows: list[dict]) -> None:
    print(f"\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'check':<52} {'rel err':>10}")
    for name, err in checks.items():
        flag = "" if "(info)" in name or err < TOL else "  FAIL"
        print(f"{name:<52} {err:10.2e}{flag}")
    print(f"\n{'batch-1':<9}{'N x K':>13}{'ceiling':>9}{'fp8 def':>9}{'fp8 best':>9}{'of ceil':>8}{'fp8 dot':>9}"
          f"{'bf16 gemv':>10}{'cuBLAS':>8}  (us per product; best fp8 rows tiles)")  # fmt: skip
    for r in (r for r in rows if r["table"] == "gemv"):
        size = f"{r['n']} x {r['k']}"
        print(f"{r['shape']:<9}{size:>13}{r['ceiling_us']:9.1f}{r['fp8_default_us']:9.1f}"
              f"{r['fp8_best_us']:9.1f}{r['ceiling_us'] / r['fp8_best_us']:8.2f}{r['fp8_dot_us']:9.1f}"
              f"{r['bf16_gemv_us']:10.1f}{r['bf16_cublas_us']:8.1f}  {tuple(r['fp8_best_tiles'].values())}")  # fmt: skip
    for r in (r for r in rows if r["table"] == "step"):
        print(
            f"step of 144 products, {r['case']}: {r['ms']:.3f} ms vs ceiling {r['ceiling_ms']:.3f} ms "
            f"= {r['of_ceiling']:.3f} of the ceiling (goal >= 0.85)"
        )
    for r in (r for r in rows if r["table"] == "prologue"):
        print(f"{r['model']} qkv + gate_up + down with their prologues: separate {r['separate_ms']:.3f} ms, fused "
              f"{r['fused_ms']:.3f} ms; of the ceiling {r['ceiling_ms'] / r['fused_ms']:.3f} fused")  # fmt: skip
    print(f"\n{'GEMM':<16}{'bf16':>9}{'fp8 lin':>9}{'w8a8':>9}{'w8a8 best':>10}{'TFLOPS bf16/fp8':>17}  (us)")
    for r in (r for r in rows if r["table"] == "gemm"):
        case = f"M={r['m']} {r['shape']}"
        print(f"{case:<16}{r['bf16_us']:9.1f}{r['fp8_linear_us']:9.1f}{r['w8a8_default_us']:9.1f}"
              f"{r['w8a8_best_us']:10.1f}{r['bf16_tflops']:9.0f}/{r['w8a8_best_tflops']:<7.0f}")  # fmt: skip
    print(
        f"\n{'MoE 30B-A3B':<14}{'bf16':>9}{'fp8 w-only':>11}{'fp8 w8a8':>10}{'default':>13}{'fp8 ceiling':>12}  (us)"
    )
    for r in (r for r in rows if r["table"] == "moe"):
        ceiling = f"{r['fp8_ceiling_us']:.1f}" if r["t"] == 1 else "-"
        print(f"{'T=' + str(r['t']):<14}{r['bf16_us']:9.1f}{r['fp8_weight-only_us']:11.1f}{r['fp8_w8a8_us']:10.1f}"
              f"{r['default_form']:>13}{ceiling:>12}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller tile sweeps")
    parser.add_argument("--gemm-m", default="256,4096",
                        help="the GEMM table's row counts (<= 128: the batched-decode tile sweep as well)")
    args = parser.parse_args()
    gemm_ms = tuple(int(m) for m in args.gemm_m.split(","))
    dev = torch.device("cuda")
    print(
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}",
        flush=True,
    )
    copy_bw = copy_bandwidth()
    checks: dict[str, float] = {}
    try:
        check(checks, dev)
    except Exception as exc:  # report it, and still time
        print(f"checks raised {type(exc).__name__}: {exc}"[:600], flush=True)
        checks["checks raised"] = float("inf")
    print("checks done", flush=True)
    rows: list[dict] = []
    rows_sweep = ROWS_SWEEP[:4] if args.quick else ROWS_SWEEP
    best = time_gemv(rows, dev, copy_bw, rows_sweep)
    time_step(rows, dev, copy_bw, best)
    for model in ("8b", "0.6b"):
        rows.append(prologue_case(model, checks, dev, copy_bw))
        torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    time_gemm_and_moe(rows, dev, copy_bw, W8A8_SWEEP[:2] if args.quick else W8A8_SWEEP, gemm_ms)
    summary = {"copy_bw": copy_bw, "checks": checks, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_fp8.json").write_text(json.dumps(summary, indent=1))
    print_table(copy_bw, checks, rows)
    failed = [n for n, e in checks.items() if "(info)" not in n and not e < TOL]
    print(
        f"\n{len(checks) - len(failed)}/{len(checks)} checks passed"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
