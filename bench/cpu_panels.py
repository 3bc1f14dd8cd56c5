"""Float32 products of a few rows on the CPU at SmolLM2-135M's weight shapes: kernels/cpu/panels.cpp's
12-column panels against oneDNN's prepacked weights (what the Engine took for every batch before) and F.linear.

    .venv/bin/python bench/cpu_panels.py [--rows 1,2,4,8,16,24,32,64,256] [--repeats 5]

One "pass" multiplies M rows by every weight of a decode step in the model's order (30 layers of qkv, o,
gate_up and down, each its own weights, then the tied LM head: 538 MB, so the weights come from memory as in a
real step; bench/cpu_matvec.py's weights and pass). The options run one pass each in turn, REPEATS times
(the same load for all); the table gives the median pass, its GFLOP/s, and oneDNN's time over the panels'.
The read-only pass over the same bytes bounds every product from below (`read ms`). JSON: bench/out/cpu_panels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cpu_matvec import MERGED, model_weights, one_pass, read_ceiling  # noqa: E402
from kernels.cpu_matvec import load_matvec, matvec_isa  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "cpu_panels.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,64,256", help="comma-separated row counts M")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_matvec()
    ops = torch.ops.radixserve_cpu
    weights = model_weights(MERGED)
    plain = [w for _, w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in plain]
    panels = [ops.pack_panels(w) for w in plain]
    options = {
        "panels": lambda i, x: ops.panel_linear(x, panels[i]),
        "onednn": lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "F.linear": lambda i, x: F.linear(x, plain[i]),
    }
    nbytes = sum(w.numel() * 4 for w in plain)
    flops_per_row = 2 * sum(w.numel() for w in plain)
    read_gbs = read_ceiling(weights, args.repeats)
    print(f"{torch.get_num_threads()} threads, path {matvec_isa()}, {nbytes / 1e6:.0f} MB a pass, read-only "
          f"{read_gbs:.1f} GB/s ({nbytes / read_gbs / 1e6:.1f} ms), load average {os.getloadavg()[0]:.2f}")
    print(f"{'rows':>5s} " + " ".join(f"{name + ' ms':>12s}" for name in options) + f" {'panels GFLOP/s':>15s}"
          f" {'onednn / panels':>16s}")
    rows_out = []
    with torch.inference_mode():
        for m in (int(v) for v in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]) for w in plain]
            runs: dict[str, list[float]] = {name: [] for name in options}
            for product in options.values():
                one_pass(weights, product, xs)
            for _ in range(args.repeats):
                for name, product in options.items():
                    runs[name].append(one_pass(weights, product, xs)["pass"])
            ms = {name: statistics.median(r) * 1e3 for name, r in runs.items()}
            gflops = flops_per_row * m / (ms["panels"] / 1e3) / 1e9
            rows_out.append({"rows": m, "pass_ms": ms, "runs_s": runs, "panels_gflop_s": gflops,
                             "onednn_over_panels": ms["onednn"] / ms["panels"]})
            print(f"{m:5d} " + " ".join(f"{ms[name]:12.2f}" for name in options)
                  + f" {gflops:15.1f} {ms['onednn'] / ms['panels']:16.2f}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "torch": torch.__version__, "threads": torch.get_num_threads(), "isa": matvec_isa(),
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown",
        "bytes_per_pass": nbytes, "read_gb_s": read_gbs, "rows": rows_out,
    }, indent=2))


if __name__ == "__main__":
    main()
