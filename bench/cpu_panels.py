"""Float32 products of a few rows on the CPU at SmolLM2-135M's weight shapes: kernels/cpu/panels.cpp's
12-column panels against oneDNN's prepacked weights (what the Engine took for every batch before) and F.linear.

    .venv/bin/python bench/cpu_panels.py [--rows 1,2,4,8,16,24,32,64,256] [--repeats 5] [--dtype bfloat16]

One "pass" multiplies M rows by every weight of a decode step in the model's order (30 layers of qkv, o,
gate_up and down, each its own weights, then the tied LM head: 538 MB, so the weights come from memory as in a
real step; bench/cpu_matvec.py's weights and pass). The options run one pass each in turn, REPEATS times
(the same load for all); the table gives the median pass, its GFLOP/s, and oneDNN's time over the panels'.
The read-only pass over the same bytes bounds every product from below (`read ms`). JSON: bench/out/cpu_panels.json.
--dtype bfloat16 runs the same weights rounded to bfloat16: the widening panels, the pair panels (vdpbf16ps)
where the CPU runs it, oneDNN's layout where it packs bfloat16 (JSON: bench/out/cpu_panels_bfloat16.json).
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
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: the widening panels, the pair panels (vdpbf16ps, where the CPU runs it) "
                        "and oneDNN's bfloat16 layout (where it packs bfloat16)")  # fmt: skip
    args = parser.parse_args()
    load_matvec()
    ops = torch.ops.radixserve_cpu
    dtype = getattr(torch, args.dtype)
    weights = [(name, w.to(dtype)) for name, w in model_weights(MERGED)]
    plain = [w for _, w in weights]
    panels = [ops.pack_panels(w) for w in plain]
    options = {"panels": lambda i, x: ops.panel_linear(x, panels[i])}
    if dtype == torch.bfloat16 and ops.pair_panels_native():
        pairs = [ops.pack_panels(w, True) for w in plain]
        options["pairs"] = lambda i, x: ops.panel_linear(x, pairs[i])
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in plain]
        options["onednn"] = lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
    options["F.linear"] = lambda i, x: F.linear(x, plain[i])
    best = "pairs" if "pairs" in options else "panels"  # the panels' figure the ratio and GFLOP/s take
    nbytes = sum(w.numel() * w.element_size() for w in plain)
    flops_per_row = 2 * sum(w.numel() for w in plain)
    read_gbs = read_ceiling(weights, args.repeats)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, path {matvec_isa()}, {nbytes / 1e6:.0f} MB a pass, read-only "
          f"{read_gbs:.1f} GB/s ({nbytes / read_gbs / 1e6:.1f} ms), load average {os.getloadavg()[0]:.2f}")
    print(f"{'rows':>5s} " + " ".join(f"{name + ' ms':>12s}" for name in options) + f" {best + ' GFLOP/s':>15s}"
          f" {'onednn / ' + best:>16s}")
    rows_out = []
    with torch.inference_mode():
        for m in (int(v) for v in args.rows.split(",")):
            xs = [torch.randn(m, w.shape[1]).to(dtype) for w in plain]
            runs: dict[str, list[float]] = {name: [] for name in options}
            for product in options.values():
                one_pass(weights, product, xs)
            for _ in range(args.repeats):
                for name, product in options.items():
                    runs[name].append(one_pass(weights, product, xs)["pass"])
            ms = {name: statistics.median(r) * 1e3 for name, r in runs.items()}
            gflops = flops_per_row * m / (ms[best] / 1e3) / 1e9
            ratio = ms["onednn"] / ms[best] if "onednn" in ms else float("nan")
            rows_out.append({"rows": m, "pass_ms": ms, "runs_s": runs, f"{best}_gflop_s": gflops,
                             f"onednn_over_{best}": ratio})
            print(f"{m:5d} " + " ".join(f"{ms[name]:12.2f}" for name in options) + f" {gflops:15.1f} {ratio:16.2f}")
    OUT.parent.mkdir(exist_ok=True)
    out = OUT.with_name("cpu_panels_bfloat16.json") if dtype == torch.bfloat16 else OUT
    out.write_text(json.dumps({
        "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(), "isa": matvec_isa(),
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown",
        "bytes_per_pass": nbytes, "read_gb_s": read_gbs, "rows": rows_out,
    }, indent=2))


if __name__ == "__main__":
    main()
