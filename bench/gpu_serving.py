"""Serving workloads through the offline Engine on one GPU, each figure beside its ceiling.

    python bench/gpu_serving.py --figures p3,p4,p6 [--model /tmp/rs-qwen3-0.6b-bfloat16] [--scale 1.0]

P3  offline throughput, nano-vllm's recipe: 256 requests, input and output lengths uniform in
    [100, 1024], ignore_eos. Ceiling: sum over decode steps of (weight bytes + KV bytes read) / copy
    bandwidth, plus prefill FLOPs / matmul rate, both measured in this run.
P4  shared prefix: 64 groups x 16 prompts (2048-token shared system prompt + 128-token question),
    256 output tokens: cache hit rate vs the ideal, throughput with the radix cache on vs off.
P5  overlap scheduling on vs off on the P3 workload (scaled by --p5-scale): throughput ratio.
P6  chunked prefill: 32 decoding streams while a 32k-token prompt arrives; p99 / median inter-token
    latency of the streams with chunking (+ mixed chunks) and without, timed at the scheduler (the
    scheduler runs in this process for it, as in gpu_profile_step.py).
--scale shrinks request counts (a quick look); figures for RESULTS.md use 1.0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_common import OUT, copy_bandwidth, matmul_rate, weight_bytes  # noqa: E402
from services.worker.config import EngineConfig  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402
from services.worker.frontend.scheduler_loop import SchedulerLoop  # noqa: E402
from services.worker.runtime.model_config import ModelConfig  # noqa: E402
from services.worker.scheduler.req import Req  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 10, 150000


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def kv_bytes_per_token(mc: ModelConfig) -> int:
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # bf16


def p3(path: Path, bw: float, flops: float, scale: float, engine_kw: dict) -> dict:
    rng = random.Random(0)
    n = max(8, int(256 * scale))
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    prompts = [rand_ids(rng, i) for i in ins]
    params = [{"temperature": 0.6, "ignore_eos": True, "max_new_tokens": o, "seed": k} for k, o in enumerate(outs)]
    mc = ModelConfig.from_path(path)
    arrivals: list[tuple[float, int]] = []
    with Engine(str(path), **engine_kw) as e:
        e.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4})
        on_outputs = e._on_outputs

        def timed_outputs(outputs, on_outputs=on_outputs) -> None:
            # The caller's view of the step timeline: when each step's outputs arrive, and how many.
            arrivals.append((time.perf_counter(), len(outputs)))
            on_outputs(outputs)

        e._on_outputs = timed_outputs
        e._client._on_outputs = timed_outputs
        info_before = e.get_server_info()
        t0 = time.perf_counter()
        e.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        info_after = e.get_server_info()
    steps_before, steps_after = info_before["stats"], info_after["stats"]
    loop = {k: round(v - info_before["loop_seconds"][k], 3) for k, v in info_after["loop_seconds"].items()}
    # Ceiling: every decode step reads all weights and the KV of every running request once.
    w, kvb = weight_bytes(path), kv_bytes_per_token(mc)
    floor = 2 * (w / 2) * sum(ins) / flops  # prefill: 2 FLOPs per parameter per token (bf16: bytes/2 params)
    for t in range(max(outs)):
        running = [(i, o) for i, o in zip(ins, outs) if o > t]
        floor += (w + kvb * sum(i + t for i, _ in running)) / bw
    tok_s = sum(outs) / dt
    return {"requests": n, "output_tokens": sum(outs), "seconds": dt, "tok_s": tok_s,
            "ceiling_tok_s": sum(outs) / floor, "ratio": floor / dt,
            "steps": {k: steps_after[k] - steps_before.get(k, 0) for k in steps_after if k.startswith("num_")},
            "loop_seconds": loop, "timeline": step_timeline(t0, arrivals)}


def step_timeline(t0: float, arrivals: list[tuple[float, int]]) -> dict:
    """Gaps between consecutive steps' outputs reaching the caller, by how many requests the step advanced."""
    if not arrivals:
        return {}
    buckets: dict[str, list[float]] = {}
    for (t_prev, _), (t, n) in zip(arrivals, arrivals[1:]):
        buckets.setdefault(f"{min(256, (n + 63) // 64 * 64):>3}", []).append(t - t_prev)
    out = {"first_output_s": arrivals[0][0] - t0, "arrivals": len(arrivals)}
    for key in sorted(buckets):
        g = sorted(buckets[key])
        out[f"outputs<= {key.strip()}"] = {"n": len(g), "total_s": round(sum(g), 3),
                                          "median_ms": round(g[len(g) // 2] * 1e3, 3)}
    return out


def p5(path: Path, bw: float, flops: float, scale: float, engine_kw: dict) -> dict:
    off = p3(path, bw, flops, scale, {**engine_kw, "disable_overlap_schedule": True})
    on = p3(path, bw, flops, scale, {**engine_kw, "disable_overlap_schedule": False})
    return {"overlap_off_tok_s": off["tok_s"], "overlap_on_tok_s": on["tok_s"], "speedup": on["tok_s"] / off["tok_s"]}


def p4(path: Path, scale: float, engine_kw: dict) -> dict:
    rng = random.Random(1)
    groups, per_group = max(2, int(64 * scale)), 16
    prompts = []
    for _ in range(groups):
        system = rand_ids(rng, 2048)
        prompts += [system + rand_ids(rng, 128) for _ in range(per_group)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 256}
    total_prompt = sum(len(p) for p in prompts)
    ideal = groups * (per_group - 1) * 2048 / total_prompt
    res = {}
    for label, disable in (("cache_on", False), ("cache_off", True)):
        with Engine(str(path), disable_radix_cache=disable, schedule_policy="lpm", **engine_kw) as e:
            t0 = time.perf_counter()
            out = e.generate(input_ids=prompts, sampling_params=params)
            dt = time.perf_counter() - t0
        cached = sum(o["meta_info"]["cached_tokens"] for o in out)
        res[label] = {"seconds": dt, "tok_s": len(prompts) * 256 / dt, "hit_rate": cached / total_prompt}
    res["ideal_hit_rate"] = ideal
    res["hit_rate_vs_ideal"] = res["cache_on"]["hit_rate"] / ideal
    res["speedup"] = res["cache_off"]["seconds"] / res["cache_on"]["seconds"]
    return res


def _itl_run(loop: SchedulerLoop, long_prompt: list[int], streams: int, rng: random.Random) -> list[float]:
    """Inter-token gaps of `streams` greedy streams while a long prompt is served, timed where the
    scheduler hands each step's tokens out (step() returning), so the caller's own pace cannot bunch
    them. The prompt is added once every stream has 32 tokens; gaps count from then until 0.2 s after
    its prefill has finished."""
    s = loop.scheduler
    for k in range(streams):
        sp = SamplingParams(max_new_tokens=100_000, temperature=0, ignore_eos=True)
        sp.normalize()
        s.add_request(Req(f"itl-{k}", rand_ids(rng, 64), sp, seed=k))
    counts: dict[str, int] = {}
    last: dict[str, float] = {}  # each stream's latest token, so the gap the prompt's arrival opens counts
    while len(counts) < streams or min(counts.values()) < 32:
        outputs = s.step()
        now = time.perf_counter()
        for out in outputs:
            counts[out.rid] = counts.get(out.rid, 0) + len(out.token_ids)
            last[out.rid] = now
    sp = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    sp.normalize()
    s.add_request(Req("long", long_prompt, sp, seed=0))
    gaps: list[float] = []
    done_at = None
    t_open = time.perf_counter()
    while done_at is None or time.perf_counter() - done_at < 0.2:
        outputs = s.step()
        now = time.perf_counter()
        for out in outputs:
            if out.rid == "long":
                if out.finished_reason is not None:
                    done_at = now
                continue
            if out.rid in last:
                gaps.append(now - last[out.rid])
            last[out.rid] = now
    for k in range(streams):
        s.abort_request(f"itl-{k}")
    while s.has_work():
        s.step()
    print(f"  long prompt served {done_at - t_open:.3f} s after it was added; {len(gaps)} gaps", flush=True)
    return gaps


def p6(path: Path, scale: float, engine_kw: dict) -> dict:
    rng = random.Random(2)
    long_prompt = rand_ids(rng, int(32768 * max(scale, 0.125)))
    res = {}
    for label, kw in (("chunked_mixed", {"chunked_prefill_size": 2048, "enable_mixed_chunk": True}),
                      ("chunked", {"chunked_prefill_size": 2048}),
                      ("unchunked", {"chunked_prefill_size": None, "max_prefill_tokens": 65536})):
        config = EngineConfig(model_path=str(path), max_total_tokens=200_000, **kw,
                              **{k: v for k, v in engine_kw.items() if k != "scheduler_process"})
        loop = SchedulerLoop(config, 0, "tcp://127.0.0.1:0")
        gaps = sorted(_itl_run(loop, long_prompt, 32, rng))
        del loop
        gc.collect()
        torch.cuda.empty_cache()
        med, p99 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.99)]
        res[label] = {"median_ms": med * 1e3, "p99_ms": p99 * 1e3, "p99_over_median": p99 / med,
                      "max_ms": gaps[-1] * 1e3, "gaps": len(gaps)}
        print(f"  {label}: {json.dumps(res[label])}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--figures", default="p3,p4,p6")
    ap.add_argument("--model", default="/tmp/rs-qwen3-0.6b-bfloat16")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--json", default="gpu_serving.json", help="file name under $OUT for the results")
    ap.add_argument("--p5-scale", type=float, default=0.5)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--scheduler-thread", action="store_true",
                    help="run the Engine's scheduler in a thread of this process (default on CUDA: its own process)")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: from free memory)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the Engine's --quantization (fp8: the linear weights quantized to block FP8 at load)")
    args = ap.parse_args()
    path = Path(args.model)
    engine_kw: dict = {}
    if args.cuda_graph_max_bs is not None:
        engine_kw["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    if args.scheduler_thread:
        engine_kw["scheduler_process"] = False
    if args.max_total_tokens:
        engine_kw["max_total_tokens"] = args.max_total_tokens
    if args.quantization:
        engine_kw["quantization"] = args.quantization
    bw, flops = copy_bandwidth(), matmul_rate()
    results: dict = {"copy_GBps": bw / 1e9, "matmul_TFLOPs": flops / 1e12, "engine": engine_kw}
    runs = {
        "p3": lambda: p3(path, bw, flops, args.scale, engine_kw),
        "p4": lambda: p4(path, args.scale, engine_kw),
        "p5": lambda: p5(path, bw, flops, args.p5_scale, engine_kw),
        "p6": lambda: p6(path, args.scale, engine_kw),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    failed = False
    for fig in progress_bar(args.figures.split(","), desc="figures", lines_when_piped=False):
        t0 = time.perf_counter()
        try:
            results[fig] = runs[fig]()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next figure
            failed = True
            results[fig] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"[{time.perf_counter() - t0:6.1f} s] {fig}: {json.dumps(results[fig])}")
        (OUT / args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
