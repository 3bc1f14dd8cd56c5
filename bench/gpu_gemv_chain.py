"""The narrow batch-1 products of a Qwen3-0.6B step (o_proj 1024 x 2048, down_proj 1024 x 3072) under each
GEMV tile, timed inside the chain of products a decode step runs.

    python bench/gpu_gemv_chain.py [--layers 28] [--reps 50]     (GPU, repository root)

A 0.6B step's profile (bench/gpu_profile_step.py --graph-timeline) puts o_proj at 2.2x and down_proj at
2.5x their byte floor: N = 1,024 output rows make 64 programs of 16 rows, half the SMs. Timing a product
alone (the Engine's calibration, linear_calibration.py) misses what matters in a step: how early each
kernel starts under PDL and what it reads before its wait. So this bench builds the chain itself, with
kernels/gemv.py's own entry points and launch options, per layer:
    qkv = rmsnorm_gemv(h, res)  ->  o = gemv(qkv[:2048])  ->  gate_up = rmsnorm_gemv(o, h)  ->  down = silu_mul_gemv(gate_up)
(each reading the one before's output; the attention between qkv and o is left out), every layer with
its own random weights, in a CUDA graph, and replays it. The wide products keep --wide tiles; o_proj then
down_proj take each candidate (GEMV_CANDIDATES' "rows" tiles, GEMV_SPLIT_CANDIDATES', and thinner row
blocks: more programs without a reduction), the other at --wide. RS_PDL* switches apply as in the Engine
(kernels/pdl.py, kernels/gemv.py), so run it once per setting.

Per candidate: the chain's time a step (median of --reps replays, each timed alone), the change
against --wide on both, and the product's increment per layer beside its byte floor (weight bytes / copy
bandwidth). Checks: each candidate's last output is close to the --wide one's (a different block_k or
split changes the order of the sums: close, not equal), and the split ticket counters are back at zero.
JSON to $OUT/gpu_gemv_chain<suffix>.json (suffix: the RS_ switches set, as gpu_profile_step names its
timeline); a table closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402
from kernels.gemv import GemvTiles, gemv, rmsnorm_gemv, silu_mul_gemv  # noqa: E402
from kernels.split_reduce import ticket_counters  # noqa: E402
from services.worker.runtime.layers.linear_calibration import (  # noqa: E402
    GEMV_CANDIDATES,
    GEMV_SPLIT_CANDIDATES,
    cuda_graph_seconds,
)

HIDDEN, INTER, Q_OUT, QKV_OUT = 1024, 3072, 2048, 4096  # Qwen3-0.6B: 16 q heads, 8 kv heads, head_dim 128
NARROW = {"o": (HIDDEN, Q_OUT), "down": (HIDDEN, INTER)}
# Thinner row blocks: 128 or 256 programs for N = 1,024 without a split's reduction.
THIN_CANDIDATES = ((8, 2048, 8, 1, "rows"), (8, 1024, 8, 1, "rows"), (8, 1024, 4, 1, "rows"), (4, 1024, 4, 1, "rows"),
                   (4, 2048, 4, 1, "rows"))


def candidates() -> list[GemvTiles]:
    rows = [GemvTiles(*c) for c in GEMV_CANDIDATES if c[4] == "rows"]
    return rows + [GemvTiles(*c) for c in GEMV_SPLIT_CANDIDATES + THIN_CANDIDATES]


def label(t: GemvTiles) -> str:
    return f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}" + (f" split {t.split}" if t.split > 1 else "")


def switches() -> str:
    """The RS_ switches set in the environment, for the JSON's name."""
    on = sorted(k for k, v in os.environ.items() if k.startswith("RS_") and v not in ("", "0"))
    return "".join(f"_{k.removeprefix('RS_').lower()}" for k in on)


class Chain:
    def __init__(self, layers: int, wide: GemvTiles) -> None:
        torch.manual_seed(0)
        dev, dt = "cuda", torch.bfloat16

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=dev, dtype=dt) * 0.02

        self.layers = [
            {"qkv": w(QKV_OUT, HIDDEN), "o": w(HIDDEN, Q_OUT), "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER),
             "n1": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dt), "n2": 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dt)}
            for _ in range(layers)
        ]  # fmt: skip
        self.h0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
        self.wide = wide
        self.out: torch.Tensor | None = None

    def run(self, tiles: dict[str, GemvTiles]) -> None:
        h, res = self.h0, None
        for lw in self.layers:
            qkv, res = rmsnorm_gemv(h, res, lw["n1"], 1e-6, lw["qkv"], self.wide)
            o = gemv(qkv[:, :Q_OUT], lw["o"], tiles=tiles.get("o", self.wide))
            gate_up, res = rmsnorm_gemv(o, res, lw["n2"], 1e-6, lw["gate_up"], self.wide)
            h = silu_mul_gemv(gate_up, lw["down"], tiles.get("down", self.wide))
        self.out = h

    def time(self, tiles: dict[str, GemvTiles], reps: int) -> tuple[float, torch.Tensor]:
        """Seconds of one replay of the chain as a CUDA graph (median of reps) and its last output."""
        self.run(tiles)  # compile, and make the ticket counters before capture
        seconds = cuda_graph_seconds(lambda: self.run(tiles), reps)
        assert self.out is not None
        return seconds, self.out.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50, help="replays timed a candidate (their median)")
    ap.add_argument("--wide", default="16,1024,8,1", help="block_n,block_k,warps,stages of the other products")
    args = ap.parse_args()
    wide = GemvTiles(*(int(v) for v in args.wide.split(",")))
    bw = copy_bandwidth()
    chain = Chain(args.layers, wide)
    base_s, base_out = chain.time({}, args.reps)
    result: dict = {"copy_bandwidth_gb_s": bw / 1e9, "layers": args.layers, "switches": switches() or "none",
                    "wide": label(wide), "base_us": base_s * 1e6, "rows": []}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; chain of {args.layers} layers, every product at {label(wide)}: "
          f"{base_s * 1e6:.1f} us", flush=True)
    failed = False
    for name, (n, k) in NARROW.items():
        floor_us = n * k * 2 / bw * 1e6
        for t in candidates():
            if not t.fits(k) or t.block_k > 2 * k:
                continue
            try:
                s, out = chain.time({name: t}, args.reps)
            except Exception as exc:  # a tile the compiler rejects (registers, shared memory): said, skipped
                print(f"  {name} {label(t)}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            err = ((out.float() - base_out.float()).abs().max() / base_out.float().abs().max()).item()
            zero = not ticket_counters("cuda").any().item()
            failed |= err > 2e-2 or not zero
            row = {"product": name, "tiles": label(t), "chain_us": s * 1e6, "delta_us_per_layer": (s - base_s) * 1e6 / args.layers,
                   "floor_us": floor_us, "max_rel_diff": err, "counters_zero": zero}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(OUT).mkdir(parents=True, exist_ok=True)
    (Path(OUT) / f"gpu_gemv_chain{switches()}.json").write_text(json.dumps(result, indent=1))
    print(f"\nswitches: {result['switches']}; base {base_s * 1e6:.1f} us a step ({label(wide)} everywhere)")
    print(f"{'product':8} {'tiles':26} {'chain us':>9} {'d/layer':>8} {'floor':>6} {'rel diff':>9} counters0")
    for r in result["rows"]:
        print(f"{r['product']:8} {r['tiles']:26} {r['chain_us']:9.1f} {r['delta_us_per_layer']:8.2f} "
              f"{r['floor_us']:6.2f} {r['max_rel_diff']:9.1e} {r['counters_zero']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
