"""Decode CUDA graphs on one GPU: the same greedy tokens with and without them, then decode speed.

    python bench/gpu_cuda_graph.py

Random-init Qwen3-shaped checkpoints (no weights can be downloaded there), reused from /tmp when an
earlier run (this script or bench/gpu_engine.py) left them.
Checks (float32, so rounding cannot flip a near-tie), on the Qwen3-0.6B shape and on a small Qwen3-MoE:
5 requests of mixed prompt lengths and mixed max_new_tokens (the batch shrinks 5 -> 1, so several graph
sizes and padded rows are used), greedy, cuda_graph_max_bs=32 against cuda_graph_max_bs=0: identical
tokens, log-probs of the chosen tokens close.
Figures (bf16): batch-1 decode tok/s with graphs for the 0.6B and 8B shapes against the ceiling
(weight bytes read per step / measured device copy bandwidth), batch-64 decode throughput for 0.6B,
and the same 0.6B figures without graphs for comparison.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gpu_common  # noqa: E402
from bench.gpu_common import OUT, build_checkpoint, copy_bandwidth, weight_bytes  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402

POOL = 65536
# A stuck run is killed (with every thread's traceback) before the device lease runs out.
WATCHDOG_S = 345


def build_moe_checkpoint() -> Path:
    """A small random Qwen3-MoE (4 layers, 32 experts top-4, float32): exercises the fused MoE kernel
    inside the graphs."""
    return gpu_common.build_moe_checkpoint(
        "small-float32", torch.float32, 0.1, vocab_size=32000, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=512, max_position_embeddings=4096,
    )


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(10, 150000, (n,), generator=gen).tolist()


def greedy_with_logprobs(
    path: Path, prompts: list[list[int]], max_new: list[int], **kw: object
) -> tuple[list[list[int]], list[list[float]]]:
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in max_new]
    with Engine(str(path), max_total_tokens=POOL, **kw) as e:
        res = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ids = [r["output_ids"] for r in res]
    logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in res]
    return ids, logprobs


def batch1_decode_speed(e: Engine, steps: int) -> float:
    """Decode tok/s of one request after a 128-token prompt (prefill time measured and taken out)."""
    prompt = list(range(1000, 1128))
    greedy = {"temperature": 0, "ignore_eos": True}
    e.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 8})
    t0 = time.perf_counter()
    e.generate(input_ids=prompt[:-1] + [7], sampling_params={**greedy, "max_new_tokens": 1})
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    e.generate(input_ids=prompt[:-2] + [9, 9], sampling_params={**greedy, "max_new_tokens": steps})
    total = time.perf_counter() - t0
    return (steps - 1) / max(total - ttft, 1e-9)


def batch_decode_throughput(e: Engine, bs: int, steps: int, seed: int) -> float:
    """Decode tok/s of bs requests together (128-token distinct prompts; prefill time taken out)."""
    gen = torch.Generator().manual_seed(seed)
    greedy = {"temperature": 0, "ignore_eos": True}
    e.generate(input_ids=[random_ids(gen, 128) for _ in range(bs)], sampling_params={**greedy, "max_new_tokens": 8})
    t0 = time.perf_counter()
    e.generate(input_ids=[random_ids(gen, 128) for _ in range(bs)], sampling_params={**greedy, "max_new_tokens": 1})
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    e.generate(
        input_ids=[random_ids(gen, 128) for _ in range(bs)], sampling_params={**greedy, "max_new_tokens": steps + 1}
    )
    total = time.perf_counter() - t0
    return bs * steps / max(total - prefill, 1e-9)


class Report:
    """Rows of the final table; a section that raises records its error and the run goes on."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []
        self.results: dict[str, object] = {}
        self.ok = True
        self.t0 = time.perf_counter()

    def add(self, key: str, value: str) -> None:
        self.rows.append((key, value))
        print(f"[{time.perf_counter() - self.t0:6.1f} s] {key}: {value}", flush=True)

    def section(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # one failed section must not hide the others
            traceback.print_exc()
            self.ok = False
            self.add(f"{name} FAILED", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def check_tokens(report: Report, name: str, path: Path, vocab: int) -> None:
    gen = torch.Generator().manual_seed(5)
    # 300 + 64 tokens needs two KV splits in decode attention; the others one.
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 300)]
    max_new = [64, 50, 37, 23, 9]
    kw = dict(attention_backend="triton", dtype="float32")
    eager, eager_lp = greedy_with_logprobs(path, prompts, max_new, cuda_graph_max_bs=0, **kw)
    graph, graph_lp = greedy_with_logprobs(path, prompts, max_new, cuda_graph_max_bs=32, **kw)
    same = eager == graph
    report.ok &= same
    diverge = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))
        for x, y in zip(eager, graph)
    ]
    lp_diff = max(
        (abs(a - b) for xs, ys, d in zip(eager_lp, graph_lp, diverge) for a, b in list(zip(xs, ys))[:d]),
        default=0.0,
    )
    report.results[f"check_{name}"] = {"tokens_identical": same, "first_divergence_per_request": diverge,
                                        "max_abs_logprob_diff": lp_diff}
    report.add(f"{name}: graphs == eager greedy tokens (fp32, 5 reqs, bs 5->1)",
               f"{same}; first divergence per request {diverge}; max |dlogprob| {lp_diff:.2e}")


def measure_0_6b(report: Report, bw: float, graph_bs: int) -> None:
    path = build_checkpoint("0.6b", torch.bfloat16)
    ceiling = bw / weight_bytes(path)
    for label, max_bs, steps, bs64_steps in (("graphs", graph_bs, 256, 128), ("eager", 0, 64, 32)):
        with Engine(str(path), max_total_tokens=POOL, attention_backend="triton", cuda_graph_max_bs=max_bs) as e:
            tps = batch1_decode_speed(e, steps)
            report.add(f"Qwen3-0.6b bs1 decode (bf16, {label})",
                       f"{tps:.1f} tok/s ({1e3 / tps:.2f} ms/step); ceiling {ceiling:.0f}; ratio {tps / ceiling:.3f}")
            thr = batch_decode_throughput(e, 64, bs64_steps, seed=11)
            report.add(f"Qwen3-0.6b bs64 decode (bf16, {label})", f"{thr:.0f} tok/s ({64e3 / thr:.2f} ms/step)")
        report.results[f"0.6b_{label}"] = {"bs1_tok_s": tps, "ceiling_tok_s": ceiling, "ratio": tps / ceiling,
                                           "bs64_tok_s": thr}


def measure_8b(report: Report, bw: float, graph_bs: int) -> None:
    path = build_checkpoint("8b", torch.bfloat16)
    ceiling = bw / weight_bytes(path)
    with Engine(str(path), max_total_tokens=POOL, attention_backend="triton", cuda_graph_max_bs=graph_bs) as e:
        tps = batch1_decode_speed(e, 256)
    report.add("Qwen3-8b bs1 decode (bf16, graphs)",
               f"{tps:.1f} tok/s ({1e3 / tps:.2f} ms/step); ceiling {ceiling:.0f}; ratio {tps / ceiling:.3f}")
    report.results["8b_graphs"] = {"bs1_tok_s": tps, "ceiling_tok_s": ceiling, "ratio": tps / ceiling}


def main() -> int:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("services.worker.runtime.cuda_graph_runner").setLevel(logging.INFO)
    report = Report()
    report.section("token check", lambda: check_tokens(report, "Qwen3-0.6b", build_checkpoint("0.6b", torch.float32),
                                                       151936))
    report.section("moe token check", lambda: check_tokens(report, "Qwen3-MoE small", build_moe_checkpoint(), 32000))
    bw = copy_bandwidth()
    report.add("device copy bandwidth (read+write)", f"{bw / 1e9:.0f} GB/s")
    report.section("0.6b speed", lambda: measure_0_6b(report, bw, graph_bs=64))
    report.section("8b speed", lambda: measure_8b(report, bw, graph_bs=32))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_cuda_graph.json").write_text(json.dumps({"rows": report.rows, "results": report.results}, indent=2))
    print("\n== gpu_cuda_graph ==")
    for key, value in report.rows:
        print(f"{key:66s} {value}")
    print(f"total {time.perf_counter() - report.t0:.0f} s; {'OK' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
