"""PNG plots of the recorded figures (bench/results/*.json: the GPU ones copied from the device runs'
$OUT, the CPU pipeline's written here).

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


def gap_bars(ax: plt.Axes, p6: dict, title: str) -> None:
    """Median, p99 and longest inter-token gap per P6 mode, on a log scale (gaps under 1 us drawn at 1 us)."""
    modes = list(p6)
    x = range(len(modes))
    for k, (key, color) in enumerate((("median_ms", "tab:blue"), ("p99_ms", "tab:orange"), ("max_ms", "tab:red"))):
        ax.bar([i + 0.27 * (k - 1) for i in x], [max(p6[m][key], 1e-3) for m in modes], width=0.27, color=color,
               label=key.replace("_ms", ""))
    ax.set_xticks(list(x), modes)
    ax.set_yscale("log")
    ax.set_ylabel("inter-token gap, ms")
    ax.set_title(title)
    ax.legend()


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
    gap_bars(axes[3], res["p6"], "P6 streams during a 32k-token prefill")
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


def plot_decode_second_run() -> None:
    """P2 after the fused attention prologue (gpu_engine_s2) beside P1 from gpu_tp's TP=1 run."""
    p2 = load("gpu_engine_s2")["results"]["0.6b"]
    tp = load("gpu_tp")["results"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    bars(axes[0], ["radixserve", "ceiling", "target"], [p2["tok_s"], p2["ceiling_tok_s"], 1000.0],
         ["tab:blue", "tab:gray", "tab:green"])
    axes[0].set_title(f"Qwen3-0.6B batch-1 decode, second run (ratio {p2['ratio']:.3f})")
    axes[0].set_ylabel("tokens/s")
    labels = ["TP=1\nbs1", "TP=2\nbs1", "TP=1\nbs64 /50", "TP=2\nbs64 /50"]
    values = [tp["8b_tp1"]["bs1_tok_s"], tp["8b_tp2"]["bs1_tok_s"],
              tp["8b_tp1"]["bs64_tok_s"] / 50, tp["8b_tp2"]["bs64_tok_s"] / 50]
    bars(axes[1], labels, values, ["tab:blue", "tab:orange", "tab:blue", "tab:orange"])
    axes[1].set_title("Qwen3-8B decode, TP=1 vs TP=2 (NCCL, 2x H200)")
    axes[1].set_ylabel("tokens/s (batch 64 divided by 50)")
    fig.tight_layout()
    fig.savefig(PLOTS / "p1_p2_tp_second_run.png", dpi=110)


def plot_pipeline() -> None:
    """The CPU pipeline vs the in-process Engine: added floor and added TTFT, with and without the
    gateway tokenizing."""
    runs = {"tokenizer service": load("pipeline_cpu"), "gateway tokenizes": load("pipeline_cpu_gateway_tokenizes")}
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values, colors = [], [], []
    for name, r in runs.items():
        labels += [f"floor\n{name}", f"TTFT\n{name}"]
        values += [r["floor"]["added_median_ms"], r["ttft"]["added_median_ms"]]
        colors += ["tab:gray", "tab:blue"]
    bars(ax, labels, values, colors)
    ax.axhline(2.0, color="tab:green", linestyle="--", label="target 2 ms")
    ax.set_ylabel("added ms (median of pairs)")
    ax.set_title("NATS pipeline vs in-process Engine (CPU, 2 vCPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOTS / "pipeline_cpu.png", dpi=110)


def plot_spec() -> None:
    """Speculative decoding, Qwen3-8B-shaped batch 1: speedup against mean accepted length."""
    rows = sorted(json.loads((RESULTS / "gpu_spec.json").read_text()), key=lambda r: r["accept_length"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["accept_length"] for r in rows], [r["speedup"] for r in rows], "o-", color="tab:blue")
    for r in rows:
        ax.annotate(f"eps {r['eps']:g}", (r["accept_length"], r["speedup"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.axhline(1.5, color="tab:green", linestyle="--", label="target 1.5x where accept >= 2.5")
    ax.axvline(2.5, color="tab:green", linestyle=":")
    ax.set_xlabel("mean accepted length (tokens per verify step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Speculative decoding, Qwen3-8B-shaped, batch 1, k=4")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "spec_gpu.png", dpi=110)


def plot_serving_s3() -> None:
    """P3 through the bare scheduler, the Engine with its scheduler in a process and in a thread,
    against the ceiling; P6 gaps while a 32k-token prompt is served."""
    res = load("gpu_serving_s3")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    p3 = res["p3_engine_process"]
    bars(axes[0], ["scheduler\nloop", "Engine\n(process)", "Engine\n(thread)", "ceiling"],
         [res["p3_scheduler_direct"]["tok_s"], p3["tok_s"], res["p3_engine_thread"]["tok_s"], p3["ceiling_tok_s"]],
         ["tab:blue", "tab:blue", "tab:orange", "tab:gray"])
    axes[0].set_title(f"P3 offline throughput, Qwen3-0.6B-shaped (Engine ratio {p3['ratio']:.3f})")
    axes[0].set_ylabel("output tokens/s")
    gap_bars(axes[1], res["p6"], "P6: 32 streams while a 32k-token prompt is served")
    fig.tight_layout()
    fig.savefig(PLOTS / "p3_p6_serving_s3.png", dpi=110)


def plot_sixth_session() -> None:
    """Sixth session: decode attention launch shapes at P3's batch, P3 through the Engine call by call,
    P4/P5 re-checked, P6 per mixed-step policy, and P1/P2 beside transformers' compiled generate."""
    fig, axes = plt.subplots(1, 5, figsize=(27, 4.2))
    sweep = [r for r in load("gpu_decode_sweep_s6")["rows"] if r["case"] == "p3 bs256"]
    by = {r["variant"]: r["ratio"] for r in sweep}
    names = [("default", "before"), ("head_major", "+ head grid"), ("k_rows", "+ K rows"), ("hm+kr", "both"),
             ("hm+kr n128w4s2", "both +\n128 keys")]
    bars(axes[0], [label for _, label in names], [by[key] for key, _ in names], ["tab:gray"] + ["tab:blue"] * 4)
    axes[0].set_title("decode attention, batch 256 (P3's contexts)")
    axes[0].set_ylabel("KV bytes / s over copy bandwidth")
    p3 = [load(f"gpu_serving_s6_call{i}{suffix}")["p3"] for i, suffix in ((1, "_p3"), (2, "_p3"), (3, ""))]
    bars(axes[1], ["session start", "+ decode tiles", "+ text once", "ceiling"],
         [p3[0]["tok_s"], p3[1]["tok_s"], p3[2]["tok_s"], p3[2]["ceiling_tok_s"]],
         ["tab:gray", "tab:blue", "tab:blue", "tab:gray"])
    axes[1].axhline(0.6 * p3[2]["ceiling_tok_s"], color="tab:green", linestyle="--", label="target 0.6")
    axes[1].set_title(f"P3 through the Engine (ratio {p3[2]['ratio']:.3f})")
    axes[1].set_ylabel("output tokens/s")
    axes[1].legend(fontsize=8)
    c4 = load("gpu_serving_s6_call4")
    bars(axes[2], ["P4 cache on", "P4 cache off", "P5 overlap on", "P5 overlap off"],
         [c4["p4"]["cache_on"]["tok_s"], c4["p4"]["cache_off"]["tok_s"], c4["p5"]["overlap_on_tok_s"],
          c4["p5"]["overlap_off_tok_s"]], ["tab:blue", "tab:orange", "tab:blue", "tab:orange"])
    axes[2].set_title(f"P4 {c4['p4']['speedup']:.2f}x (hit {c4['p4']['hit_rate_vs_ideal']:.0%} of ideal), "
                      f"P5 {c4['p5']['speedup']:.2f}x")
    axes[2].set_ylabel("output tokens/s")
    gap_bars(axes[3], {f"call {i}\nmixed": load(f"gpu_serving_s6_call{i}")["p6"]["chunked_mixed"] for i in (3, 4, 5)}
             | {"chunked": load("gpu_serving_s6_call5")["p6"]["chunked"],
                "unchunked": load("gpu_serving_s6_call5")["p6"]["unchunked"]},
             "P6 gaps (calls 3-5: mixed-step policies)")
    hf = load("gpu_engine_s6_hfc")["results"]
    labels, values, colors = [], [], []
    for name in ("8b", "0.6b"):
        labels += [f"{name}\nours", f"{name}\nHF eager", f"{name}\nHF compile"]
        values += [hf[name]["tok_s"], hf[name]["hf_eager_tok_s"], hf[name]["hf_compile_tok_s"]]
        colors += ["tab:blue", "tab:orange", "tab:red"]
    bars(axes[4], labels, values, colors)
    axes[4].set_yscale("log")
    axes[4].set_title(f"P1/P2 batch-1 decode (8B ratio {hf['8b']['ratio']:.3f})")
    axes[4].set_ylabel("tokens/s (log)")
    fig.tight_layout()
    fig.savefig(PLOTS / "s6_gpu.png", dpi=110)


def plot_seventh_session() -> None:
    """Seventh session: P2 with the GEMV prologues, P6 with split extend prefixes, FlashInfer vs the
    triton backend per layer, and the GPU pipeline with four gateways."""
    fig, axes = plt.subplots(1, 4, figsize=(24, 4.2))
    runs = [load(name)["results"] for name in ("gpu_engine_s6_hfc", "gpu_engine_s7", "gpu_engine_s7_call6")]
    labels, values = [], []
    for model in ("0.6b", "8b"):
        labels += [f"{model}\nsixth session", f"{model} fused\nprologues", f"{model} + tile\ncredit"]
        values += [r[model]["tok_s"] for r in runs]
    bars(axes[0], labels, values, ["tab:gray", "tab:blue", "tab:blue"] * 2)
    axes[0].axhline(1000, color="tab:green", linestyle="--", label="P2 target 1,000 tok/s")
    axes[0].set_title("P1/P2 batch-1 decode")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=8)
    gap_bars(axes[1], {"sixth\nmixed": load("gpu_serving_s6_call5")["p6"]["chunked_mixed"]}
             | {f"seventh\n{k.replace('_', ' ')}": v for k, v in load("gpu_serving_s7_p6")["p6"].items()},
             "P6 gaps: mixed steps before / after split prefixes")
    fi = {k: v for k, v in load("gpu_flashinfer_s7").items() if isinstance(v, dict) and "flashinfer_ms" in v}
    labels = [k.replace("qwen3-", "").replace("decode ", "dec\n").replace("extend ", "ext\n")
              .replace(" new, prefix ", "\n+").replace(" ctx", " ") for k in fi]
    x = range(len(fi))
    axes[2].bar([i - 0.2 for i in x], [v["triton_ms"] * 1e3 for v in fi.values()], width=0.4, label="triton")
    axes[2].bar([i + 0.2 for i in x], [v["flashinfer_ms"] * 1e3 for v in fi.values()], width=0.4, label="flashinfer")
    axes[2].set_xticks(list(x), labels, fontsize=7)
    axes[2].set_ylabel("us per layer call (eager, incl. K/V store)")
    axes[2].set_title("attention backends, bf16 (same pool and queries)")
    axes[2].legend(fontsize=8)
    runs = {"fifth session\n1 gateway": load("gpu_pipeline_s5_after"), "4 gateways": load("gpu_pipeline_s7_gateways4")}
    runs |= {label: load(name) for label, name in PIPELINE_S7_EXTRA if (RESULTS / f"{name}.json").exists()}
    labels = list(runs)
    axes[3].bar([i - 0.2 for i in range(len(runs))], [100 * r["throughput"]["loss_median"] for r in runs.values()],
                width=0.4, label="throughput loss, %")
    axes[3].bar([i + 0.2 for i in range(len(runs))], [r["ttft"]["added_median_ms"] for r in runs.values()],
                width=0.4, label="added TTFT, ms")
    axes[3].axhline(5, color="tab:blue", linestyle=":", label="loss target 5 %")
    axes[3].axhline(2, color="tab:orange", linestyle=":", label="TTFT target 2 ms")
    axes[3].set_xticks(range(len(runs)), labels, fontsize=7)
    axes[3].set_title("GPU pipeline vs in-process Engine")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "s7_gpu.png", dpi=110)


# Later GPU pipeline runs of the seventh session (label, JSON name), drawn when recorded.
PIPELINE_S7_EXTRA = (("+ fast path,\nraw client", "gpu_pipeline_s7_gateways4_after"),
                     ("the same,\nagain", "gpu_pipeline_s7_gateways4_rerun"),
                     ("+ gateway\ntokenizes", "gpu_pipeline_s7_gateway_tokenizes"))


# The eighth session's GPU pipeline runs (label, JSON name): "old" is the seventh session's tree.
PIPELINE_S8 = (("call 1\n4 gw", "gpu_pipeline_s8_call1_gateways4"), ("call 1\n1 gw", "gpu_pipeline_s8_call1_gateways1"),
               ("call 2\nnew", "gpu_pipeline_s8_call2_ab_new_1"), ("call 2\nold", "gpu_pipeline_s8_call2_ab_old_1"),
               ("call 2\nnew", "gpu_pipeline_s8_call2_ab_new_2"), ("call 2\nold", "gpu_pipeline_s8_call2_ab_old_2"),
               ("call 3\nnew", "gpu_pipeline_s8_call3_default_a"), ("call 3\nnew", "gpu_pipeline_s8_call3_default_b"),
               ("call 3\ngw tokenizes", "gpu_pipeline_s8_call3_gateway_tokenizes"),
               ("call 5\nuvloop", "gpu_pipeline_s8_call5_uvloop_a"), ("call 5\nuvloop", "gpu_pipeline_s8_call5_uvloop_b"))


def plot_eighth_session() -> None:
    """Added TTFT (prompts of ids; text where timed) and added floor per GPU pipeline run, and the three
    CPU pipeline runs."""
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    runs = [(label, load(name)) for label, name in PIPELINE_S8]
    x = range(len(runs))
    for offset, key, label in ((-0.27, "ttft", "added TTFT, ids"), (0.0, "ttft_text", "added TTFT, text"),
                               (0.27, "floor", "added floor")):
        values = [(r.get(key) or {}).get("added_median_ms", 0.0) for _, r in runs]
        axes[0].bar([i + offset for i in x], values, width=0.27, label=label)
    axes[0].axhline(2, color="tab:red", linestyle=":", label="TTFT target 2 ms")
    axes[0].set_xticks(list(x), [label for label, _ in runs], fontsize=7)
    axes[0].set_ylabel("ms over the in-process Engine (median of pairs)")
    axes[0].set_title("GPU pipeline, tokenizer service unless said (new: ids straight to the worker)")
    axes[0].legend(fontsize=7)
    cpu = [load(f"pipeline_cpu_s8_run{i}") for i in (1, 2, 3)]
    for offset, key, label in ((-0.27, "ttft", "TTFT, ids"), (0.0, "ttft_text", "TTFT, text"), (0.27, "floor", "floor")):
        axes[1].bar([i + offset for i in range(3)], [r[key]["added_median_ms"] for r in cpu], width=0.27, label=label)
    axes[1].axhline(2, color="tab:red", linestyle=":")
    axes[1].set_xticks(range(3), ["run 1", "run 2", "run 3"], fontsize=8)
    axes[1].set_title("CPU pipeline (2 vCPUs), added ms")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOTS / "s8_pipeline.png", dpi=110)


def main() -> None:
    PLOTS.mkdir(exist_ok=True)
    plot_decode()
    plot_serving()
    plot_kernels()
    plot_decode_second_run()
    plot_pipeline()
    plot_spec()
    plot_serving_s3()
    plot_sixth_session()
    plot_seventh_session()
    plot_eighth_session()
    print(f"plots in {PLOTS}")


if __name__ == "__main__":
    main()
