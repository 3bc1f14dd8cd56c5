"""Profile the real scheduler on the GPU: where a step's host time goes (cProfile), which kernels the
device runs (torch.profiler), what an eager EXTEND forward costs, and a step timeline of the P3
workload, to find what bounds each figure.

    python bench/gpu_profile_step.py [--model DIR] [--batch 1] [--prompt 128] [--temperature 0]
                                     [--host-profile] [--extend] [--p3-timeline [--scale 1.0]]
                                     [--deterministic] [--quantization fp8] [--graph-timeline]

--graph-timeline: the decode graph's kernels on the device's clock (graph_timeline below): what each
kernel adds to the step's critical path, by its place in a decoder layer, printed and written to
$OUT/gpu_graph_timeline_<model>[_<rs switch><value>...].json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.config import EngineConfig  # noqa: E402
from services.worker.frontend.scheduler_loop import SchedulerLoop  # noqa: E402
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from services.worker.scheduler.req import Req  # noqa: E402
from services.worker.scheduler.schedule_batch import ScheduleBatch  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def params(max_new: int, temperature: float) -> SamplingParams:
    p = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True)
    p.normalize()
    return p


def decode_profile(loop: SchedulerLoop, args: argparse.Namespace) -> None:
    s = loop.scheduler
    for i in range(args.batch):
        s.add_request(Req(f"r{i}", [(1000 + i * 7 + j) % loop.runner.model_config.vocab_size for j in range(args.prompt)],
                          params(500, args.temperature), seed=i))
    while s.waiting or s.chunked_req:
        s.step()
    for _ in range(20):
        s.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(50):
        s.step()
    sync()
    step_ms = (time.perf_counter() - t0) / 50 * 1e3
    print(f"batch {args.batch}, prompt {args.prompt}, temperature {args.temperature}: step {step_ms:.2f} ms, "
          f"{args.batch / step_ms * 1e3:.0f} tok/s")
    # The step's forward alone: its decode graph replayed back to back (the last step's inputs), so the
    # difference from the step above is what the step does besides the forward (sampling, the token's copy
    # to the host, the scheduler's own work not hidden behind the GPU).
    graphs = loop.runner.graph_runner
    g = graphs._decode_graph(args.batch) if graphs is not None and torch.cuda.is_available() else None
    if g is not None and g.graph is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            g.graph.replay()
        start.record()
        for _ in range(100):
            g.graph.replay()
        end.record()
        sync()
        replay_ms = start.elapsed_time(end) / 100
        print(f"decode graph (bs {g.batch_size}) replayed alone: {replay_ms:.3f} ms; the step's other work: "
              f"{step_ms - replay_ms:.3f} ms")
        out = Path(os.environ.get("OUT", "bench/out"))
        out.mkdir(parents=True, exist_ok=True)
        name = f"gpu_profile_step_{os.environ.get('RS_STEP_KERNELS', '1')}.json"  # RS_STEP_KERNELS A/B sides
        if args.graph_timeline:
            timeline = graph_timeline(g.graph, loop.runner.model_config.num_layers)
            timeline.update(model=args.model, quantization=args.quantization, batch=args.batch,
                            device=torch.cuda.get_device_name(), graph_replay_ms=replay_ms)
            # Named by the RS_ switches set too: A/B sides in one call must not overwrite each other.
            switches = "".join(f"_{k.lower()}{v}" for k, v in sorted(os.environ.items()) if k.startswith("RS_"))
            (out / f"gpu_graph_timeline_{Path(args.model).name}{'-fp8' if args.quantization else ''}{switches}.json"
             ).write_text(json.dumps(timeline, indent=1))
        (out / name).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch, "prompt": args.prompt,
            "env": {k: v for k, v in os.environ.items() if k.startswith("RS_")},
            "step_ms": step_ms, "graph_replay_ms": replay_ms, "other_ms": step_ms - replay_ms,
        }, indent=2))
    if args.host_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            s.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            s.step()
        sync()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    while s.has_work():
        for r in s.running:
            s.abort_request(r.rid)
        s.step()


def graph_timeline(graph: torch.cuda.CUDAGraph, num_layers: int, replays: int = 8) -> dict:
    """Each kernel of a decode graph's replay on the device's clock (torch.profiler's CUPTI records, one
    replay at a time with the host idle between them). A kernel's *increment* is how far its end moves
    the replay's latest end: end_i - max(end_j, j < i), the part of the step it alone accounts for (with
    PDL a kernel starts before the one ahead of it ends, so its duration overstates it); its *lead* is
    how early it started, max(end_j, j < i) - start_i. Kernels are labelled by their place after the
    layer's attention launch (the one launched `num_layers` times), medians over the layers and replays."""
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            sync()
            time.sleep(0.002)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events if e.get("cat") == "kernel"
    )
    return timeline_table(kernels, num_layers)


def timeline_table(kernels: list[tuple[float, float, str]], num_layers: int) -> dict:
    """graph_timeline's table from (start us, end us, name) records sorted by start."""
    runs: list[list[tuple[float, float, str]]] = []
    for k in kernels:  # replays are >= 2 ms apart; kernels of one replay never are
        if not runs or k[0] - max(e for _, e, _ in runs[-1]) > 1000.0:
            runs.append([])
        runs[-1].append(k)
    names = [n for _, _, n in runs[-1]]
    counts = {n: names.count(n) for n in names}
    per_layer = [n for n in names if counts[n] == num_layers]
    if not per_layer:
        raise ValueError(f"no kernel runs once per layer ({num_layers}) in a replay of {len(names)} kernels: "
                         "the table places kernels by the layer's attention launch")
    anchor = next((n for n in per_layer if "decode" in n), per_layer[0])
    rows: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    totals = []
    for run in runs[1:]:  # the first replay after the profiler starts is discarded
        latest, t0 = run[0][0], run[0][0]
        anchors = [i for i, (_, _, n) in enumerate(run) if n == anchor]
        period = anchors[1] - anchors[0] if len(anchors) > 1 else len(run)
        for i, (start, end, name) in enumerate(run):
            short = name.split("(")[0].split("<")[0].replace("void ", "")[-48:]
            base = max((a for a in anchors if a <= i), default=-1)
            if base < 0:
                label = f"head {i} {short}"
            elif base == anchors[-1] and i - base >= period - 1:  # after the last layer's own kernels
                label = f"tail +{i - base} {short}"
            else:
                label = f"layer +{i - base} {short}"
            rows[label].append((max(0.0, end - latest), latest - start, end - start))
            latest = max(latest, end)
        totals.append(latest - t0)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    table = []
    for label, xs in rows.items():
        per_replay = len(xs) / max(1, len(runs) - 1)
        inc = median([x[0] for x in xs])
        table.append({"kernel": label, "per_replay": per_replay, "increment_us": inc,
                      "lead_us": median([x[1] for x in xs]), "duration_us": median([x[2] for x in xs]),
                      "increment_total_us": inc * per_replay})
    replay_us = median(totals)
    print(f"graph timeline: {len(runs[-1])} kernels a replay, {replay_us:.1f} us first start to last end "
          f"(median of {len(totals)} profiled replays)")
    print(f"{'kernel (place)':58} {'n':>4} {'incr us':>8} {'lead us':>8} {'dur us':>8} {'incr total':>10}")
    for r in table:
        print(f"{r['kernel']:58} {r['per_replay']:4.0f} {r['increment_us']:8.2f} {r['lead_us']:8.2f} "
              f"{r['duration_us']:8.2f} {r['increment_total_us']:10.1f}")
    return {"replay_us": replay_us, "kernels_per_replay": len(runs[-1]), "anchor": anchor, "table": table}


def extend_probe(loop: SchedulerLoop, host_profile: bool = False) -> None:
    """Host launch and wall time of EXTEND forwards (a CUDA-graph replay where a bucket holds the batch,
    else eager), and the host ops of the smallest one."""
    s, runner = loop.scheduler, loop.runner
    rng = random.Random(0)

    def prepare(reqs: list[Req]) -> ForwardBatch:
        for r in reqs:
            r.fill_ids, r.prefix_indices, r.kv_committed_len = list(r.origin_input_ids), torch.empty(0, dtype=torch.int64), 0
        return ScheduleBatch(reqs, ForwardMode.EXTEND, s.mem).prepare_extend()

    def release(reqs: list[Req]) -> None:
        for r in reqs:
            runner.allocator.free(runner.req_to_token_pool.read(r.req_pool_idx, 0, r.kv_committed_len))
            runner.req_to_token_pool.free(r.req_pool_idx)
            r.req_pool_idx = None

    vocab = runner.model_config.vocab_size
    for reqs_n, tokens in [(1, 5), (4, 5), (1, 128), (1, 2048), (16, 128)]:
        if tokens >= runner.model_config.context_len:
            continue
        reqs = [Req(f"x{reqs_n}-{tokens}-{i}", [rng.randrange(10, vocab) for _ in range(tokens)], params(1, 0.0), seed=i)
                for i in range(reqs_n)]
        times = []
        for _ in range(6):
            fb = prepare(reqs)
            sync()
            t0 = time.perf_counter()
            runner.forward(fb)
            t_launch = time.perf_counter() - t0
            sync()
            times.append((t_launch, time.perf_counter() - t0))
            release(reqs)
        launch, total = sorted(times[2:])[len(times[2:]) // 2]
        print(f"extend step {reqs_n} req x {tokens} tokens: host launch {launch * 1e3:.2f} ms, "
              f"wall {total * 1e3:.2f} ms")
        if host_profile and (reqs_n, tokens) == (1, 128):
            fb = prepare(reqs)
            prof = cProfile.Profile()
            prof.enable()
            runner.forward(fb)
            prof.disable()
            sync()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            release(reqs)
        if (reqs_n, tokens) == (1, 5):
            fb = prepare(reqs)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as p:
                runner.forward(fb)
                sync()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
            release(reqs)


def p3_timeline(loop: SchedulerLoop, scale: float) -> None:
    """The P3 workload through the scheduler, each step timed by its mode and batch size."""
    s = loop.scheduler
    rng = random.Random(0)
    n = max(8, int(256 * scale))
    top = min(1024, loop.runner.model_config.context_len // 2)
    ins = [rng.randint(100 * top // 1024, top) for _ in range(n)]
    outs = [rng.randint(100 * top // 1024, top) for _ in range(n)]
    for i, (a, b) in enumerate(zip(ins, outs)):
        s.add_request(Req(f"p{i}", [rng.randrange(10, loop.runner.model_config.vocab_size) for _ in range(a)], params(b, 0.6), seed=i))
    by_kind: dict[str, list[float]] = defaultdict(list)
    prev_prefill, prev_decode = 0, 0
    sync()
    t_start = time.perf_counter()
    while s.has_work():
        t0 = time.perf_counter()
        s.step()
        dt = time.perf_counter() - t0
        st = s.stats
        if st.num_prefill_steps > prev_prefill:
            kind = "extend"
        elif st.num_decode_steps > prev_decode:
            bs = len(s.running)
            kind = f"decode bs {min(256, (bs + 63) // 64 * 64):>3}"
        else:
            kind = "drain"
        prev_prefill, prev_decode = st.num_prefill_steps, st.num_decode_steps
        by_kind[kind].append(dt)
    total = time.perf_counter() - t_start
    print(f"P3 timeline: {n} requests, {sum(outs)} output tokens in {total:.2f} s = {sum(outs) / total:.0f} tok/s")
    for kind in sorted(by_kind):
        t = sorted(by_kind[kind])
        print(f"  {kind:<14} steps {len(t):>5}  total {sum(t):7.2f} s  median {t[len(t) // 2] * 1e3:7.2f} ms"
              f"  p90 {t[int(len(t) * 0.9)] * 1e3:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/rs-qwen3-0.6b-bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--host-profile", action="store_true")
    ap.add_argument("--extend", action="store_true", help="time EXTEND forwards")
    ap.add_argument("--p3-timeline", action="store_true", help="step timeline of the P3 workload")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    ap.add_argument("--graph-timeline", action="store_true", help="the decode graph's kernels on the device clock")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the Engine's --quantization (fp8: block FP8 linear weights quantized at load)")
    args = ap.parse_args()
    # The worker's tiles per weight shape for single-row products (model_runner logs them at INFO): which
    # tiles calibration chose is part of what a run measured.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("services.worker.runtime.model_runner").setLevel(logging.INFO)
    pool = max(400_000 if args.p3_timeline else 65536, args.batch * (args.prompt + 600))
    loop = SchedulerLoop(EngineConfig(
        model_path=args.model, max_total_tokens=pool, enable_deterministic_inference=args.deterministic,
        quantization=args.quantization,
    ), 0, "tcp://127.0.0.1:0")
    if args.extend:
        extend_probe(loop, args.host_profile)
    if args.p3_timeline:
        p3_timeline(loop, args.scale)
    if args.batch > 0:
        decode_profile(loop, args)


if __name__ == "__main__":
    main()
