"""Single-row float32 products on the CPU at the weight shapes of SmolLM2-135M: GB/s of weight streamed.

    .venv/bin/python bench/cpu_matvec.py [--threads 1,2] [--repeats 7]

One "pass" multiplies one row by every weight of a batch-1 decode step in the model's order (30 layers
of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], then the tied LM head
[49152, 576]: 538 MB), so the weights come from memory as in a real step, not from cache. Each product
option runs one pass in turn, REPEATS times alternating (the same load for all), and a table gives the
median pass and GB/s per shape:
  - F.linear: torch's product on the plain weight (MKL's matrix-vector product);
  - onednn: the weight prepacked for oneDNN (what the Engine uses from two rows);
  - mv: torch.mv, MKL's sgemv directly;
  - mkl_linear: MKL's packed-weight product (torch.ops.mkl._mkl_linear, as inductor's CPU path uses);
  - matvec: kernels/cpu_matvec.py (where it builds), on its best path and on AVX2 where that is not it (the
    path an AVX2-only CPU runs, timed on this one).
The same with q/k/v and gate/up as separate matrices (--split) shows what the merged projections save.
The ceiling: a read-only pass (torch.sum) over the same bytes. JSON goes to bench/out/cpu_matvec.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.cpu_matvec import MatvecUnavailable, load_matvec, matvec_isa, use_matvec_isa  # noqa: E402

LAYERS = 30
MERGED = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SPLIT = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576), "gate": (1536, 576),
         "up": (1536, 576), "down": (576, 1536)}  # fmt: skip
LM_HEAD = (49152, 576)
OUT = Path(__file__).resolve().parent / "out" / "cpu_matvec.json"

Product = Callable[[int, torch.Tensor], torch.Tensor]


def model_weights(shapes: dict[str, tuple[int, int]]) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    weights = [
        (name, torch.randn(shape, generator=g) * 0.05)
        for _ in range(LAYERS)
        for name, shape in shapes.items()
    ]
    return weights + [("lm_head", torch.randn(LM_HEAD, generator=g) * 0.05)]


def products(weights: list[tuple[str, torch.Tensor]]) -> dict[str, Product]:
    plain = [w for _, w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in plain]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in plain]
    options: dict[str, Product] = {
        "F.linear": lambda i, x: F.linear(x, plain[i]),
        "onednn": lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "mv": lambda i, x: torch.mv(plain[i], x[0]),
        "mkl_linear": lambda i, x: torch.ops.mkl._mkl_linear(x, mkl[i], plain[i], None, 1),
    }
    try:
        matvec = load_matvec()
    except MatvecUnavailable as exc:
        print(f"matvec not available: {exc}")
        return options
    best = matvec_isa()
    for isa in [best] + [p for p in ("avx2",) if p != best and isa_available(p)]:
        options[f"matvec ({isa})"] = _on_isa(isa, lambda i, x: matvec(x, plain[i]))
    use_matvec_isa(best)
    return options


def isa_available(isa: str) -> bool:
    """Whether this CPU runs kernels/cpu_matvec.py's `isa` path (the path in use is left as it was)."""
    before = matvec_isa()
    try:
        use_matvec_isa(isa)
    except RuntimeError:
        return False
    use_matvec_isa(before)
    return True


def _on_isa(isa: str, product: Product) -> Product:
    """`product` on the matvec library's `isa` path: chosen at a pass's first product (weight 0)."""

    def run(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 0:
            use_matvec_isa(isa)
        return product(i, x)

    return run


def one_pass(
    weights: list[tuple[str, torch.Tensor]], product: Product, xs: list[torch.Tensor]
) -> dict[str, float]:
    """Seconds per weight name (summed over the layers) and in all ("pass")."""
    seconds: dict[str, float] = {"pass": 0.0}
    for i, (name, _) in enumerate(weights):
        start = time.perf_counter()
        product(i, xs[i])
        dt = time.perf_counter() - start
        seconds[name] = seconds.get(name, 0.0) + dt
        seconds["pass"] += dt
    return seconds


def read_ceiling(weights: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    """GB/s of a read-only pass over the same bytes (torch.sum of one flat copy)."""
    flat = torch.cat([w.flatten() for _, w in weights])
    flat.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat.sum()
        times.append(time.perf_counter() - start)
    return flat.numel() * flat.element_size() / statistics.median(times) / 1e9


def measure(shapes: dict[str, tuple[int, int]], threads: list[int], repeats: int) -> dict[str, object]:
    weights = model_weights(shapes)
    xs = [torch.randn(1, w.shape[1]) for _, w in weights]
    nbytes: dict[str, int] = {}
    for name, w in weights:
        nbytes[name] = nbytes.get(name, 0) + w.numel() * 4
    nbytes["pass"] = sum(nbytes.values())
    options = products(weights)
    result: dict[str, object] = {"bytes": nbytes}
    for n in threads:
        torch.set_num_threads(n)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in options}
        with torch.inference_mode():
            for product in options.values():
                one_pass(weights, product, xs)
            for _ in range(repeats):
                for name, product in options.items():
                    runs[name].append(one_pass(weights, product, xs))
        gbs = {
            name: {key: nbytes[key] / statistics.median(r[key] for r in rs) / 1e9 for key in nbytes}
            for name, rs in runs.items()
        }
        ms = {name: statistics.median(r["pass"] for r in rs) * 1e3 for name, rs in runs.items()}
        ceiling = read_ceiling(weights, repeats)
        result[f"threads_{n}"] = {"gb_per_s": gbs, "pass_ms": ms, "read_ceiling_gb_per_s": ceiling}
        keys = list(nbytes)
        print(f"\n{n} thread(s), {nbytes['pass'] / 1e6:.0f} MB a pass, read-only ceiling {ceiling:.1f} GB/s")
        print(f"{'product':18s} {'pass ms':>8s} " + " ".join(f"{k:>8s}" for k in keys) + "   (GB/s)")
        for name in options:
            print(f"{name:18s} {ms[name]:8.2f} " + " ".join(f"{gbs[name][k]:8.1f}" for k in keys))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--split", action="store_true", help="also q/k/v and gate/up as separate matrices")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    out = {"merged": measure(MERGED, threads, args.repeats)}
    if args.split:
        out["split"] = measure(SPLIT, threads, args.repeats)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1))
    print(f"\nJSON: {OUT}")


if __name__ == "__main__":
    main()
