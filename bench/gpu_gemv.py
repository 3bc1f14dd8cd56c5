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

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, SHAPES, copy_bandwidth  # noqa: E402
from kernels.gemv import GemvTiles, gemv  # noqa: E402
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402


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
    return cuda_graph_seconds(fn, reps)


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
    dot_tiles = GemvTiles(32, 256, 4, 3, "dot")
    same_bits = True
    for name, (_n, k) in kinds.items():
        xr = torch.randn(5, k, device="cuda", dtype=dtype)
        together = gemv(xr, weights[name][0], tiles=dot_tiles)
        ref = xr.float() @ weights[name][0].float().t()
        worst = max(worst, ((together.float() - ref).abs().max() / ref.abs().max()).item())
        same_bits &= all(torch.equal(gemv(xr[i : i + 1], weights[name][0], tiles=dot_tiles), together[i : i + 1])
                         for i in range(5))
    print(f"triton gemv (rows, and dot at 5 rows) vs float32 reference: worst max-error / max-magnitude {worst:.2e}; "
          f"dot: each row alone has the bits it has among 5: {same_bits}")

    rows_sweep = [GemvTiles(bn, bk, w, st) for bn, bk, w, st in
                  [(8, 512, 4, 3), (16, 1024, 8, 1), (32, 256, 8, 1), (16, 256, 4, 3), (16, 512, 4, 1)]]
    dot_sweep = [GemvTiles(bn, bk, 4, st, "dot")
                 for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4))]
    if args.quick:
        dot_sweep = [t for t in dot_sweep if t.num_stages == 3 and t.block_k != 128]
    results: dict[str, object] = {"copy_bw": copy_bw, "read_bw": read_bw, "max_rel_err": worst,
                                  "dot_rows_same_bits": same_bits, "shapes": {}}
    best: dict[str, dict[str, GemvTiles]] = {"rows": {}, "dot": {}}
    print(f"{'shape':<9}{'N x K':>15}{'cuBLAS':>8}{'rows':>8}{'dot':>8}{'cuBLAS@5':>9}{'dot@5':>8}  (us per call; best tiles)")
    shapes = dict(kinds, lm_head=(vocab, hidden))
    x5 = {name: torch.randn(5, k, device="cuda", dtype=dtype) for name, (n, k) in shapes.items()}
    for name, (n, k) in shapes.items():
        ws = [lm_head] * 4 if name == "lm_head" else weights[name]
        x = x_lm if name == "lm_head" else xs[name]
        outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in ws]
        outs5 = [torch.empty(5, n, device="cuda", dtype=dtype) for _ in ws]
        per = len(ws)

        def timed(tiles, rows=1, ws=ws, x=x, outs=outs, outs5=outs5, name=name, per=per):
            xin, o = (x, outs) if rows == 1 else (x5[name], outs5)

            def fn():
                for w, out in zip(ws, o):
                    if tiles is None:
                        torch.mm(xin, w.t(), out=out)
                    else:
                        gemv(xin, w, out=out, tiles=tiles)
            return graph_time(fn, reps=5) / per * 1e6

        row = {"n": n, "k": k, "cublas_us": timed(None), "cublas5_us": timed(None, 5)}
        for kind, sweep in (("rows", rows_sweep), ("dot", dot_sweep)):
            timings = []
            for tiles in progress_bar(sweep, desc=f"{name} {kind} tiles", lines_when_piped=False, leave=False):
                try:
                    timings.append((timed(tiles), tiles))
                except Exception as exc:  # a tile the compiler rejects (shared memory, registers): skipped, said
                    say(f"  {name} {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
            t, tiles = min(timings, key=lambda item: item[0])
            best[kind][name] = tiles
            row[f"{kind}_us"], row[f"{kind}_best"] = t, tiles.__dict__
            row[f"{kind}_sweep"] = [(tt, tl.__dict__) for tt, tl in timings]
        row["dot5_us"] = timed(best["dot"][name], 5)
        results["shapes"][name] = row
        print(f"{name:<9}{f'{n} x {k}':>15}{row['cublas_us']:>8.1f}{row['rows_us']:>8.1f}{row['dot_us']:>8.1f}"
              f"{row['cublas5_us']:>9.1f}{row['dot5_us']:>8.1f}  rows {best['rows'][name]}, dot {best['dot'][name]}")

    # The whole step's linears in order, as a decode step's graph would run them.
    step_bytes = sum(n * k * 2 for n, k in kinds.values()) * layers + vocab * hidden * 2

    def step(kind: str | None, rows: int = 1):
        xin = {name: (xs[name] if rows == 1 else x5[name][:, : xs[name].shape[1]]) for name in kinds}
        xl = x_lm if rows == 1 else x5["lm_head"]
        o = {name: torch.empty(rows, n, device="cuda", dtype=dtype) for name, (n, k) in shapes.items()}

        def run():
            for layer in range(layers):
                for name in kinds:
                    if kind is None:
                        torch.mm(xin[name], weights[name][layer].t(), out=o[name])
                    else:
                        gemv(xin[name], weights[name][layer], out=o[name], tiles=best[kind][name])
            if kind is None:
                torch.mm(xl, lm_head.t(), out=o["lm_head"])
            else:
                gemv(xl, lm_head, out=o["lm_head"], tiles=best[kind]["lm_head"])
        return run

    ceiling = step_bytes / copy_bw
    totals = {"cublas": graph_time(step(None)), "rows": graph_time(step("rows")), "dot": graph_time(step("dot")),
              "cublas@5": graph_time(step(None, 5)), "dot@5": graph_time(step("dot", 5))}
    print(f"all linears of one step ({step_bytes / 1e9:.2f} GB, ceiling {ceiling * 1e3:.3f} ms at the copy bandwidth): "
          + ", ".join(f"{k} {t * 1e3:.3f} ms ({ceiling / t:.3f})" for k, t in totals.items()))
    results.update(step_bytes=step_bytes, step_ceiling_ms=ceiling * 1e3,
                   step_ms={k: t * 1e3 for k, t in totals.items()})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
