"""The batched-decode FP8 layer with its rows quantized inside the norm and the activation
(kernels/fp8_quant.py: rmsnorm_group_quant_fp8, silu_mul_group_quant_fp8) against the separate launches
(kernels/rmsnorm.py's fused_add_rmsnorm or kernels/activation.py's silu_and_mul, then
per_token_group_quant_fp8), on one GPU.

    python bench/gpu_fp8_quant_fused.py [--ms 32,96,256]

Checks: the fused launches give the separate launches' bits (the e4m3 rows, their scales, the residual),
bfloat16, at the Qwen3-8B and Qwen3-0.6B widths and 17-256 rows.
Timing: a Qwen3-8B layer's products at M rows as the Engine runs them past 16 rows (norm -> qkv, o,
norm -> gate_up, SiLU-and-mul -> down, each product the w8a8 GEMM), the separate form against the fused
one, a CUDA-graph replay over 36 layers' own weights (past L2); per layer. JSON to
$OUT/gpu_fp8_quant_fused.json; the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8_gemm import per_token_group_quant_fp8, w8a8_block_fp8_matmul  # noqa: E402
from kernels.fp8_quant import rmsnorm_group_quant_fp8, silu_mul_group_quant_fp8  # noqa: E402
from kernels.fp8_reference import quantize_block_weight  # noqa: E402
from kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402

BLOCK = (128, 128)
LAYERS = 36
HIDDEN, INTER, QKV = 4096, 12288, 6144  # Qwen3-8B


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def check(dev: torch.device) -> dict[str, bool]:
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for hidden, inter in ((4096, 12288), (1024, 3072)):
        for m in (17, 96, 256):
            x = torch.randn((m, hidden), device=dev, generator=g).bfloat16() * 3
            r = torch.randn((m, hidden), device=dev, generator=g).bfloat16()
            w = (1 + 0.2 * torch.randn(hidden, device=dev, generator=g)).bfloat16()
            q, s, res = rmsnorm_group_quant_fp8(x, r, w, 1e-6)
            normed, want_res = fused_add_rmsnorm(x, r, w, 1e-6)
            want_q, want_s = per_token_group_quant_fp8(normed, 128)
            out[f"norm {hidden} x {m}"] = same(q, want_q) and same(s, want_s) and same(res, want_res)
            gu = torch.randn((m, 2 * inter), device=dev, generator=g).bfloat16() * 3
            q, s = silu_mul_group_quant_fp8(gu)
            want_q, want_s = per_token_group_quant_fp8(silu_and_mul(gu), 128)
            out[f"silu {inter} x {m}"] = same(q, want_q) and same(s, want_s)
    return out


def time_layer(m: int, dev: torch.device) -> dict[str, float]:
    ws = {name: [quantize_block_weight(torch.randn(n, k, device=dev) * 0.02, BLOCK) for _ in range(LAYERS)]
          for name, (n, k) in {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                               "down": (HIDDEN, INTER)}.items()}  # fmt: skip
    x = torch.randn((m, HIDDEN), device=dev).bfloat16()
    r = torch.randn((m, HIDDEN), device=dev).bfloat16()
    nw = torch.ones(HIDDEN, device=dev).bfloat16()
    attn = torch.randn((m, HIDDEN), device=dev).bfloat16()
    gu = torch.randn((m, 2 * INTER), device=dev).bfloat16()

    def gemm(q: torch.Tensor, s: torch.Tensor, name: str, i: int) -> torch.Tensor:
        return w8a8_block_fp8_matmul(q, s, *ws[name][i], BLOCK, out_dtype=torch.bfloat16)

    def separate(i: int) -> None:
        h, res = fused_add_rmsnorm(x, r, nw, 1e-6)
        gemm(*per_token_group_quant_fp8(h, 128), "qkv", i)
        gemm(*per_token_group_quant_fp8(attn, 128), "o", i)
        h, res = fused_add_rmsnorm(x, res, nw, 1e-6)
        gemm(*per_token_group_quant_fp8(h, 128), "gate_up", i)
        gemm(*per_token_group_quant_fp8(silu_and_mul(gu), 128), "down", i)

    def fused(i: int) -> None:
        q, s, res = rmsnorm_group_quant_fp8(x, r, nw, 1e-6)
        gemm(q, s, "qkv", i)
        gemm(*per_token_group_quant_fp8(attn, 128), "o", i)
        q, s, res = rmsnorm_group_quant_fp8(x, res, nw, 1e-6)
        gemm(q, s, "gate_up", i)
        gemm(*silu_mul_group_quant_fp8(gu), "down", i)

    row = {"m": m}
    for name, fn in (
        ("separate", separate),
        ("fused", fused),
        ("separate_again", separate),
        ("fused_again", fused),
    ):
        row[f"{name}_us"] = (
            cuda_graph_seconds(lambda fn=fn: [fn(i) for i in range(LAYERS)], reps=7) / LAYERS * 1e6
        )
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="32,96,256", help="rows of the timed layer")
    args = parser.parse_args()
    dev = torch.device("cuda")
    checks = check(dev)
    rows = [time_layer(int(m), dev) for m in args.ms.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_fp8_quant_fused.json").write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "checks": checks, "rows": rows}, indent=1)
    )
    failed = [k for k, ok in checks.items() if not ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks give the separate launches' bits"
          + (f"; DIFFER: {failed}" if failed else ""))  # fmt: skip
    print(
        f"{'rows':>5} {'separate':>10} {'fused':>10} {'again':>10} {'again':>10}  (us per 8B layer's products)"
    )
    for r in rows:
        print(f"{r['m']:5d} {r['separate_us']:10.1f} {r['fused_us']:10.1f} {r['separate_again_us']:10.1f} "
              f"{r['fused_again_us']:10.1f}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
