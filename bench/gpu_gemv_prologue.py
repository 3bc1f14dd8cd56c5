"""The GEMV prologues on the GPU: a decode step's norms, activations and projections at batch 1, with the
elementwise kernels separate or folded into the products (kernels/gemv.py), in a CUDA graph.
(The run of bench/results/gpu_gemv_prologue_2026-11-30_a.json also timed a one-pass norm variant, since
removed: bench/HISTORY.md, "GPU, seventh session".)

    python bench/gpu_gemv_prologue.py [--models 0.6b,8b]

Per layer, as the decoder runs them: add-RMSNorm -> qkv, o, add-RMSNorm -> gate_up, SiLU-and-mul -> down,
each layer with its own random weights (so reads come from memory). Two forms:
  separate    kernels/rmsnorm.py's fused_add_rmsnorm and kernels/activation.py's silu_and_mul, then gemv;
  fused       rmsnorm_gemv and silu_mul_gemv.
Each form's outputs are checked against float32 on the first layer. Tiles: per shape the fastest of
layers.linear_calibration.GEMV_CANDIDATES' "rows" tiles for the plain product. JSON to $OUT/gpu_gemv_prologue.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, SHAPES, copy_bandwidth  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.gemv import GemvTiles, gemv, rmsnorm_gemv, silu_mul_gemv  # noqa: E402
from kernels.rmsnorm import fused_add_rmsnorm  # noqa: E402
from services.worker.runtime.layers.linear_calibration import GEMV_CANDIDATES, cuda_graph_seconds  # noqa: E402

DT = torch.bfloat16
EPS = 1e-6


def best_tiles(weights: list[torch.Tensor], x: torch.Tensor) -> GemvTiles:
    candidates = [GemvTiles(*c) for c in GEMV_CANDIDATES if c[4] == "rows"]

    def seconds(tiles: GemvTiles) -> float:
        return cuda_graph_seconds(lambda: [gemv(x, w, tiles=tiles) for w in weights], 5)

    return min(candidates, key=seconds)


def model_case(name: str) -> dict:
    s = SHAPES[name]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    qkv_n = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    o_k = s["num_attention_heads"] * s["head_dim"]
    torch.manual_seed(0)
    w = {k: [torch.randn(n, kk, device="cuda", dtype=DT) * 0.02 for _ in range(layers)]
         for k, (n, kk) in {"qkv": (qkv_n, hidden), "o": (hidden, o_k), "gate_up": (2 * inter, hidden),
                            "down": (hidden, inter)}.items()}
    norms = [(1 + 0.1 * torch.randn(hidden, device="cuda")).to(DT) for _ in range(2 * layers)]
    h = torch.randn(1, hidden, device="cuda", dtype=DT)
    r = torch.randn(1, hidden, device="cuda", dtype=DT)
    attn = torch.randn(1, o_k, device="cuda", dtype=DT)
    gu = torch.randn(1, 2 * inter, device="cuda", dtype=DT)
    tiles = {"qkv": best_tiles(w["qkv"][:8], h), "o": best_tiles(w["o"][:8], attn),
             "gate_up": best_tiles(w["gate_up"][:8], h), "down": best_tiles(w["down"][:8], gu[:, :inter].contiguous())}

    def step(form: str):
        def run() -> None:
            for i in range(layers):
                if form == "separate":
                    x, res = fused_add_rmsnorm(h, r, norms[2 * i], EPS)
                    gemv(x, w["qkv"][i], tiles=tiles["qkv"])
                    gemv(attn, w["o"][i], tiles=tiles["o"])
                    x, res = fused_add_rmsnorm(h, res, norms[2 * i + 1], EPS)
                    gemv(x, w["gate_up"][i], tiles=tiles["gate_up"])
                    gemv(silu_and_mul(gu), w["down"][i], tiles=tiles["down"])
                else:
                    _, res = rmsnorm_gemv(h, r, norms[2 * i], EPS, w["qkv"][i], tiles["qkv"])
                    gemv(attn, w["o"][i], tiles=tiles["o"])
                    rmsnorm_gemv(h, res, norms[2 * i + 1], EPS, w["gate_up"][i], tiles["gate_up"])
                    silu_mul_gemv(gu, w["down"][i], tiles["down"])
        return run

    # Correctness on layer 0 against float32.
    ref_x = (h.float() + r.float())
    ref_x = ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + EPS) * norms[0].float()
    ref_qkv = ref_x @ w["qkv"][0].float().t()
    gate, up = gu.float().chunk(2, -1)
    ref_down = (torch.nn.functional.silu(gate) * up) @ w["down"][0].float().t()
    y, _ = rmsnorm_gemv(h, r, norms[0], EPS, w["qkv"][0], tiles["qkv"])
    errors = {"fused": float((y.float() - ref_qkv).norm() / ref_qkv.norm())}
    x, _ = fused_add_rmsnorm(h, r, norms[0], EPS)
    errors["separate"] = float((gemv(x, w["qkv"][0], tiles=tiles["qkv"]).float() - ref_qkv).norm() / ref_qkv.norm())
    y = silu_mul_gemv(gu, w["down"][0], tiles["down"])
    errors["silu_mul_gemv"] = float((y.float() - ref_down).norm() / ref_down.norm())
    times = {form: cuda_graph_seconds(step(form), 7) * 1e3 for form in ("separate", "fused")}
    weight_bytes = sum(t.numel() * 2 for ts in w.values() for t in ts)
    return {"tiles": {k: t.__dict__ for k, t in tiles.items()}, "rel_err_vs_fp32": errors, "step_ms": times,
            "weight_bytes": weight_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.6b,8b")
    args = ap.parse_args()
    bw = copy_bandwidth()
    results = {"copy_bw": bw}
    for name in args.models.split(","):
        r = model_case(name)
        results[name] = r
        ceiling = r["weight_bytes"] / bw * 1e3
        print(f"{name}: layers' linears + norms + activations, {r['weight_bytes'] / 1e9:.2f} GB (ceiling "
              f"{ceiling:.3f} ms): " + ", ".join(f"{k} {v:.3f} ms" for k, v in r["step_ms"].items())
              + "; rel err vs fp32 " + ", ".join(f"{k} {v:.1e}" for k, v in r["rel_err_vs_fp32"].items()), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_gemv_prologue.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
