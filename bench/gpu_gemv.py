"""Batch-1 linear layers on the GPU: cuBLAS (F.linear) vs the Triton GEMV (kernels/gemv.py) at the
shapes of a Qwen3-8B decode step, against the card's own copy and read bandwidth.

    python bench/gpu_gemv.py [--model 8b] [--quick]

Every layer gets its own random weights (36 layers of an 8B model are ~15 GB, far past L2), and each
timing replays a CUDA graph, so launch cost on the host is out and what is left is what a decode step's
graph pays. Per shape: the best Triton tile of a small sweep. Then the whole step's linears (36 layers x
qkv, o, gate_up, down, plus the LM head) with cuBLAS and with the best Triton tiles. JSON to
$OUT/gpu_gemv.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, SHAPES, copy_bandwidth  # noqa: E402
from kernels.gemv import GemvTiles, gemv  # noqa: E402


def read_bandwidth() -> float:
    """Bytes per second of a full read of 2 GiB (torch's sum; median of 10)."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    for _ in range(3):
        a.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a.sum()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    nbytes = a.numel() * 2
    del a
    torch.cuda.empty_cache()
    return nbytes / sorted(times)[len(times) // 2]


def graph_time(fn, reps: int = 10) -> float:
    """Seconds per call of fn replayed as a CUDA graph (median of reps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del graph
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b")
    parser.add_argument("--quick", action="store_true", help="a smaller tile sweep")
    args = parser.parse_args()
    shape = SHAPES[args.model]
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape.get("head_dim", 128)
    vocab = shape.get("vocab_size", 151936)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + written), read bandwidth {read_bw / 1e9:.0f} GB/s")

    kinds = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    weights = {name: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(layers)]
               for name, (n, k) in kinds.items()}
    lm_head = torch.randn(vocab, hidden, device="cuda", dtype=dtype) * 0.02
    xs = {name: torch.randn(1, k, device="cuda", dtype=dtype) for name, (n, k) in kinds.items()}
    x_lm = torch.randn(1, hidden, device="cuda", dtype=dtype)

    # Correctness at every shape, against float32 on the same inputs.
    worst = 0.0
    for name in kinds:
        ref = (xs[name].float() @ weights[name][0].float().t())
        got = gemv(xs[name], weights[name][0]).float()
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    ref = x_lm.float() @ lm_head.float().t()
    worst = max(worst, ((gemv(x_lm, lm_head).float() - ref).abs().max() / ref.abs().max()).item())
    print(f"triton gemv vs float32 reference: worst max-error / max-magnitude {worst:.2e}")

    if args.quick:
        sweep = [GemvTiles(bn, bk, w, s) for bn, bk, w, s in itertools.product((8, 16, 32), (512,), (4,), (1, 3))]
    else:
        sweep = [GemvTiles(bn, bk, w, s)
                 for bn, bk, w, s in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))]
    results: dict[str, object] = {"copy_bw": copy_bw, "read_bw": read_bw, "max_rel_err": worst, "shapes": {}}
    best_tiles: dict[str, GemvTiles] = {}
    print(f"{'shape':<10}{'N x K':>16}{'cuBLAS us':>11}{'GB/s':>7}{'triton us':>11}{'GB/s':>7}  best tile")
    shapes = dict(kinds, lm_head=(vocab, hidden))
    for name, (n, k) in shapes.items():
        ws = [lm_head] * 4 if name == "lm_head" else weights[name]
        x = x_lm if name == "lm_head" else xs[name]
        outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in ws]
        nbytes = n * k * 2 * len(ws)

        def cublas(ws=ws, x=x, outs=outs):
            for w, o in zip(ws, outs):
                torch.mm(x, w.t(), out=o)

        t_cublas = graph_time(cublas)
        timings = []
        for tiles in sweep:
            def triton_fn(ws=ws, x=x, outs=outs, tiles=tiles):
                for w, o in zip(ws, outs):
                    gemv(x, w, out=o, tiles=tiles)
            try:
                timings.append((graph_time(triton_fn, reps=5), tiles))
            except Exception as exc:  # a tile the compiler rejects (registers) is skipped, and said
                print(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
        t_triton, tiles = min(timings, key=lambda item: item[0])
        best_tiles[name] = tiles
        per = len(ws)
        print(f"{name:<10}{f'{n} x {k}':>16}{t_cublas / per * 1e6:>11.1f}{nbytes / t_cublas / 1e9:>7.0f}"
              f"{t_triton / per * 1e6:>11.1f}{nbytes / t_triton / 1e9:>7.0f}  {tiles}")
        results["shapes"][name] = {"n": n, "k": k, "cublas_us": t_cublas / per * 1e6, "triton_us": t_triton / per * 1e6,
                                   "best": tiles.__dict__,
                                   "sweep": [(t / per * 1e6, tl.__dict__) for t, tl in timings]}

    # The whole step's linears in order, as a decode step's graph would run them.
    outs = {name: torch.empty(1, n, device="cuda", dtype=dtype) for name, (n, k) in shapes.items()}
    step_bytes = sum(n * k * 2 for n, k in kinds.values()) * layers + vocab * hidden * 2

    def step(use_triton: bool):
        def run():
            for layer in range(layers):
                for name in kinds:
                    if use_triton:
                        gemv(xs[name], weights[name][layer], out=outs[name], tiles=best_tiles[name])
                    else:
                        torch.mm(xs[name], weights[name][layer].t(), out=outs[name])
            if use_triton:
                gemv(x_lm, lm_head, out=outs["lm_head"], tiles=best_tiles["lm_head"])
            else:
                torch.mm(x_lm, lm_head.t(), out=outs["lm_head"])
        return run

    t_step_cublas, t_step_triton = graph_time(step(False)), graph_time(step(True))
    ceiling = step_bytes / copy_bw
    print(f"all linears of one step ({step_bytes / 1e9:.2f} GB): cuBLAS {t_step_cublas * 1e3:.3f} ms "
          f"({ceiling / t_step_cublas:.3f} of bytes/copy-bw), triton {t_step_triton * 1e3:.3f} ms "
          f"({ceiling / t_step_triton:.3f})")
    results.update(step_bytes=step_bytes, step_cublas_ms=t_step_cublas * 1e3, step_triton_ms=t_step_triton * 1e3,
                   step_ceiling_ms=ceiling * 1e3, F_linear_check=bool(torch.equal(
                       F.linear(x_lm, lm_head), torch.mm(x_lm, lm_head.t()))))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
