"""PNG plots of the recorded GPU figures (bench/results/*.json, copied from the device runs' $OUT).

    python bench/plot_results.py        # writes bench/plots/*.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS, PLOTS = HERE / "results", HERE / "plots"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def bars(ax: plt.Axes, labels: list[str], values: list[float], colors: list[str]) -> None:
    ax.bar(labels, values, color=colors)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=8)


def plot_decode() -> None:
    res = load("gpu_engine")["results"]
    fig, axes = plt.subplots(1, len(res), figsize=(5 * len(res), 4))
    for ax, (name, r) in zip(axes, res.items()):
        bars(ax, ["radixserve", "ceiling", "HF eager"], [r["tok_s"], r["ceiling_tok_s"], r["hf_eager_tok_s"]],
             ["tab:blue", "tab:gray", "tab:orange"])
        ax.set_title(f"Qwen3-{name} batch-1 decode (ratio {r['ratio']:.3f})")
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(PLOTS / "p1_p2_decode.png", dpi=110)


def plot_serving() -> None:
    res = load("gpu_serving")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    p3 = res["p3"]
    bars(axes[0], ["radixserve", "ceiling"], [p3["tok_s"], p3["ceiling_tok_s"]], ["tab:blue", "tab:gray"])
    axes[0].set_title(f"P3 offline throughput (ratio {p3['ratio']:.3f})")
    axes[0].set_ylabel("output tokens/s")
    p4 = res["p4"]
    bars(axes[1], ["cache on", "cache off"], [p4["cache_on"]["tok_s"], p4["cache_off"]["tok_s"]],
         ["tab:blue", "tab:orange"])
    axes[1].set_title(f"P4 shared prefix: {p4['speedup']:.2f}x, hit {p4['cache_on']['hit_rate']:.1%} "
                      f"(ideal {p4['ideal_hit_rate']:.1%})")
    p5 = res["p5"]
    bars(axes[2], ["overlap off", "overlap on"], [p5["overlap_off_tok_s"], p5["overlap_on_tok_s"]],
         ["tab:orange", "tab:blue"])
    axes[2].set_title(f"P5 overlap scheduling: {p5['speedup']:.2f}x")
    p6 = res["p6"]
    modes = list(p6)
    x = range(len(modes))
    for k, (key, color) in enumerate((("median_ms", "tab:blue"), ("p99_ms", "tab:orange"), ("max_ms", "tab:red"))):
        axes[3].bar([i + 0.27 * (k - 1) for i in x], [p6[m][key] for m in modes], width=0.27, color=color,
                    label=key.replace("_ms", ""))
    axes[3].set_xticks(list(x), modes)
    axes[3].set_yscale("log")
    axes[3].set_ylabel("inter-token latency, ms")
    axes[3].set_title("P6 streams during a 32k-token prefill")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(PLOTS / "p3_p6_serving.png", dpi=110)


def plot_kernels() -> None:
    rows = load("gpu_kernels")["rows"]
    labels = [f"{r['kernel']} {r['case']}"[:48] for r in rows]
    ratios = [r["achieved"] / r["ceiling"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1))
    ax.barh(labels, ratios, color="tab:blue")
    ax.axvline(1.0, color="gray", linestyle="--")
    ax.invert_yaxis()
    ax.set_xlabel("achieved / ceiling (copy bandwidth or bf16 matmul rate, same run)")
    ax.set_title("Triton kernels on the H200")
    fig.tight_layout()
    fig.savefig(PLOTS / "kernels.png", dpi=110)


def main() -> None:
    PLOTS.mkdir(exist_ok=True)
    plot_decode()
    plot_serving()
    plot_kernels()
    print(f"plots in {PLOTS}")


if __name__ == "__main__":
    main()
