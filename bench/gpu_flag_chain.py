"""What a kernel boundary costs in a batch-1 decode step, and whether flags beat the PDL wait.

    python bench/gpu_flag_chain.py      (GPU, repository root)

A Qwen3-0.6B decode step is ~140 dependent kernels; with programmatic dependent launch (kernels/pdl.py)
each one becomes resident while the one before runs, reads its first weight tile, then waits in
`griddepcontrol.wait` for the earlier grid to *complete* and its memory to be flushed. This bench
times one chain of GEMVs shaped like the 0.6B's layers (per layer qkv 4096x1024, o 1024x2048,
gate_up 6144x1024, down 1024x3072; 28 layers; each product reading the one before's output) in a CUDA
graph, three ways:
  stream   no PDL: each kernel starts after the one before has completed;
  pdl      launch_pdl, first weight tile read before griddepcontrol.wait (as kernels/gemv.py does);
  flags    launch_pdl, first weight tile read, then the program spins on a counter that each program of
           the kernel before increments (release, gpu scope) after its stores; the last program to pass
           resets it. No grid-completion wait on the chain (the first kernel of a replay still uses
           griddepcontrol.wait).
  pdl-all  as pdl, each program reading its whole weight slice (up to 3 tiles of 1,024 columns; 8 or 16
           rows) before the wait;
and the same for a chain of near-empty kernels (the boundary alone). Checks the chain's final output is
bit-identical across stream, pdl and flags (pdl-all sums in other tiles: close, not equal). Prints a table last; JSON to $OUT/gpu_flag_chain.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, copy_bandwidth  # noqa: E402

MODES = {"stream": 0, "pdl": 1, "flags": 2, "pdl-all": 1}
SHAPES_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


@triton.jit
def _chain_gemv(X, W, Y, N, K, Wait_cnt, Ack_cnt, Sig_cnt, wait_expected, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SYNC: tl.constexpr, FIRST: tl.constexpr, PRE: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_K)
    w_first = tl.load(W + rows[:, None] * K + cols0[None, :], eviction_policy="evict_first")
    if PRE >= 2:
        w_1 = tl.load(W + rows[:, None] * K + BLOCK_K + cols0[None, :], eviction_policy="evict_first")
    if PRE >= 3:
        w_2 = tl.load(W + rows[:, None] * K + 2 * BLOCK_K + cols0[None, :], eviction_policy="evict_first")
    if SYNC == 1 or (SYNC == 2 and FIRST):
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif SYNC == 2:
        seen = tl.atomic_add(Wait_cnt, 0, sem="acquire", scope="gpu")
        while seen < wait_expected:
            seen = tl.atomic_add(Wait_cnt, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        tl.extra.cuda.gdc_launch_dependents()
        # The last program through resets the counter for the next replay (its producer runs again only
        # after this whole replay's chain, which waits on this program's own signal below).
        if tl.atomic_add(Ack_cnt, 1, sem="relaxed", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(Wait_cnt, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(Ack_cnt, 0, sem="relaxed", scope="gpu")
    acc = w_first.to(tl.float32) * tl.load(X + cols0, cache_modifier=".cg").to(tl.float32)[None, :]
    if PRE >= 2:
        acc += w_1.to(tl.float32) * tl.load(X + BLOCK_K + cols0, cache_modifier=".cg").to(tl.float32)[None, :]
    if PRE >= 3:
        acc += w_2.to(tl.float32) * tl.load(X + 2 * BLOCK_K + cols0, cache_modifier=".cg").to(tl.float32)[None, :]
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * tl.load(X + cols, cache_modifier=".cg").to(tl.float32)[None, :]
    tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty))
    if SYNC == 2:
        tl.debug_barrier()
        tl.atomic_add(Sig_cnt, 1, sem="release", scope="gpu")


class Chain:
    """A chain of products y_i = W_i x_i with x_i the first K_i elements of y_{i-1}, in a CUDA graph."""

    def __init__(self, shapes: list[tuple[int, int]], layers: int, block_n: int, block_k: int) -> None:
        torch.manual_seed(0)
        self.specs = [(n, k) for _ in range(layers) for n, k in shapes]
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for n, k in self.specs]
        width = max(max(n, k) for n, k in self.specs)
        self.x0 = torch.randn(width, device="cuda", dtype=torch.bfloat16)
        self.outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n, _ in self.specs]
        self.counters = torch.zeros(2 * (len(self.specs) + 1), device="cuda", dtype=torch.int32)
        self.block_n, self.block_k = block_n, block_k

    def run(self, name: str) -> None:
        x = self.x0
        mode = MODES[name]
        for i, ((n, k), w, y) in enumerate(zip(self.specs, self.weights, self.outs)):
            prev = self.outs[i - 1] if i else x
            wait_n = self.specs[i - 1][0] // self.block_n if i else 0
            block_n, block_k, pre, warps = self.block_n, self.block_k, 1, 4
            if name == "pdl-all" and k >= 1024:
                # The program's whole weight slice read before the wait (up to 3 tiles of 1,024 columns).
                block_n, block_k, pre, warps = (16 if n >= 4096 else 8), 1024, min(3, k // 1024), 8
            _chain_gemv[(n // block_n,)](
                prev, w, y, n, k, self.counters[2 * i - 2 if i else 0:], self.counters[2 * i - 1 if i else 1:],
                self.counters[2 * i:], wait_n, BLOCK_N=block_n, BLOCK_K=block_k, SYNC=mode,
                FIRST=i == 0, PRE=pre, num_warps=warps, num_stages=2, **({"launch_pdl": True} if mode else {}),
            )  # fmt: skip

    def time(self, mode: str, replays: int) -> tuple[float, torch.Tensor]:
        self.run(mode)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(mode)
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / replays, self.outs[-1].clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bw = copy_bandwidth()
    cases = {
        "0.6b layers (112 GEMVs)": Chain(SHAPES_06B, 28, 16, 512),
        "near-empty (112 kernels, 128 programs)": Chain([(2048, 64)], 112, 16, 64),
    }
    results: dict = {"copy_bandwidth_gb_s": bw / 1e9, "cases": {}}
    failed = False
    for name, chain in cases.items():
        per_mode: dict[str, list[float]] = {m: [] for m in MODES}
        outs = {}
        for _ in range(args.rounds):
            for mode in MODES:
                seconds, out = chain.time(mode, args.replays)
                per_mode[mode].append(seconds)
                outs[mode] = out
        # pdl-all tiles the products differently (other partial sums), so it is compared with stream only
        # within float32 rounding; the other three share the tiles and must agree bit for bit.
        same = all(torch.equal(outs[m], outs["stream"]) for m in ("pdl", "flags")) and torch.allclose(
            outs["pdl-all"].float(), outs["stream"].float(), rtol=2e-2, atol=2e-2)
        failed |= not same
        weight_bytes = sum(w.numel() * 2 for w in chain.weights)
        best = {m: min(v) for m, v in per_mode.items()}
        results["cases"][name] = {
            "kernels": len(chain.specs),
            "weight_bytes": weight_bytes,
            "bytes_floor_us": weight_bytes / bw * 1e6,
            "us": {m: [s * 1e6 for s in v] for m, v in per_mode.items()},
            "us_per_kernel_best": {m: best[m] * 1e6 / len(chain.specs) for m in MODES},
            "identical": same,
        }
        print(json.dumps({name: results["cases"][name]}), flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_flag_chain.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'case':40} {'floor us':>9} " + " ".join(f"{m + ' us':>10}" for m in MODES) + "  per kernel (us)   same")
    for name, r in results["cases"].items():
        best = {m: min(v) for m, v in r["us"].items()}
        per = " / ".join(f"{r['us_per_kernel_best'][m]:.2f}" for m in MODES)
        print(f"{name:40} {r['bytes_floor_us']:9.1f} " + " ".join(f"{best[m]:10.1f}" for m in MODES)
              + f"  {per}   {r['identical']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
