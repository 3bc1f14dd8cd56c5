"""The batch-1 MLP block as two launches (rmsnorm_gemv, silu_mul_gemv) or one persistent launch.

    python bench/gpu_persistent_mlp.py [--shapes 0.6b,8b] [--replays 50]   (GPU, repository root)

For each shape, a chain of the model's layers' MLP blocks (random bf16 weights, each block's output the
next block's input, the residual carried) is captured in a CUDA graph (PDL on where the GPU has it) two
ways, for each of a few tile choices:
  two         kernels/gemv.py's rmsnorm_gemv (gate_up) then silu_mul_gemv (down), as the Engine runs them;
  persistent  kernels/persistent_mlp.py: one launch a block, gate_up's and down's row blocks as tasks.
Check: with the same tiles the chain's final output and residual are identical bit for bit. Figure: µs
per block (median of the replays over the layers) beside the floor, the block's weight bytes / copy
bandwidth. Prints a table last; JSON to $OUT/gpu_persistent_mlp.json. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402
from kernels.gemv import GemvTiles, rmsnorm_gemv, silu_mul_gemv  # noqa: E402
from kernels.persistent_mlp import PersistentMlpTiles, persistent_mlp  # noqa: E402

# (hidden, intermediate, layers) of the Qwen3 shapes.
SHAPES = {"0.6b": (1024, 3072, 28), "1.7b": (2048, 6144, 28), "8b": (4096, 12288, 36)}
# (gate_up tiles, down tiles) tried for both forms; programs an SM for the persistent one.
TILE_CHOICES = [
    (GemvTiles(16, 512), GemvTiles(8, 512)),
    (GemvTiles(16, 1024), GemvTiles(16, 1024)),
    (GemvTiles(8, 512), GemvTiles(4, 512)),
    (GemvTiles(32, 256), GemvTiles(8, 1024)),
]
PROGRAMS_PER_SM = (2, 4, 8)


def chain(shape: str, form: str, tiles: PersistentMlpTiles):
    hidden, inter, layers = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = [
        (
            (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16(),
            (torch.randn((2 * inter, hidden), device="cuda", generator=gen) / hidden**0.5).bfloat16(),
            (torch.randn((hidden, inter), device="cuda", generator=gen) / inter**0.5).bfloat16(),
        )
        for _ in range(layers)
    ]
    x0 = torch.randn((1, hidden), device="cuda", generator=gen).bfloat16()
    r0 = torch.randn((1, hidden), device="cuda", generator=gen).bfloat16()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x, res = x0, r0
        for norm_w, w_gu, w_d in blocks:
            if form == "two":
                gu, res = rmsnorm_gemv(x, res, norm_w, 1e-6, w_gu, tiles.gate_up)
                x = silu_mul_gemv(gu, w_d, tiles.down)
            else:
                x, res = persistent_mlp(x, res, norm_w, 1e-6, w_gu, w_d, tiles)
        return x, res

    weight_bytes = sum(w.numel() * w.element_size() for _, a, b in blocks for w in (a, b))
    return run, weight_bytes, layers


def time_chain(run, replays: int) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    """Median seconds of a graph replay of `run`, and its outputs."""
    out = run()  # compile and make the counters before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), (out[0].clone(), out[1].clone())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    bw = copy_bandwidth()
    results: dict = {"copy_bandwidth_gb_s": bw / 1e9, "device": torch.cuda.get_device_name(), "shapes": {}}
    failed = False
    table = []
    for shape in args.shapes.split(","):
        rows = []
        for gate_up, down in TILE_CHOICES:
            base = PersistentMlpTiles(gate_up=gate_up, down=down)
            run, nbytes, layers = chain(shape, "two", base)
            t_two, out_two = time_chain(run, args.replays)
            floor = nbytes / bw
            row = {"gate_up": [gate_up.block_n, gate_up.block_k], "down": [down.block_n, down.block_k],
                   "two_us": t_two / layers * 1e6, "floor_us": floor / layers * 1e6, "persistent": {}}
            for per_sm in PROGRAMS_PER_SM:
                tiles = PersistentMlpTiles(gate_up=gate_up, down=down, programs_per_sm=per_sm)
                run, _, _ = chain(shape, "persistent", tiles)
                t_p, out_p = time_chain(run, args.replays)
                same = torch.equal(out_p[0], out_two[0]) and torch.equal(out_p[1], out_two[1])
                failed |= not same
                row["persistent"][per_sm] = {"us": t_p / layers * 1e6, "identical": same}
                print(f"{shape} gate_up {gate_up.block_n}x{gate_up.block_k} down {down.block_n}x{down.block_k}: "
                      f"two {row['two_us']:.2f} µs, persistent x{per_sm} {t_p / layers * 1e6:.2f} µs "
                      f"({'identical' if same else 'DIFFERENT'}), floor {row['floor_us']:.2f}", flush=True)
            rows.append(row)
        best_two = min(r["two_us"] for r in rows)
        best_p = min(p["us"] for r in rows for p in r["persistent"].values())
        results["shapes"][shape] = {"rows": rows, "best_two_us": best_two, "best_persistent_us": best_p,
                                    "floor_us": rows[0]["floor_us"]}
        table.append((shape, best_two, best_p, rows[0]["floor_us"]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_persistent_mlp.json").write_text(json.dumps(results, indent=1))
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s, {results['device']}")
    print("| shape | two launches, best (µs a block) | persistent, best | floor | persistent / two |")
    print("| --- | --- | --- | --- | --- |")
    for shape, two, pers, floor in table:
        print(f"| {shape} | {two:.2f} | {pers:.2f} | {floor:.2f} | {pers / two:.3f}× |")
    print("checks:", "FAILED" if failed else "all identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
