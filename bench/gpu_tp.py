"""Tensor parallelism on several GPUs of one host (NCCL): TP=N against TP=1 on random-init
Qwen3-8B-shaped and Qwen3-30B-A3B-shaped (MoE, fewer layers) models; no weights can be downloaded there.

    python bench/gpu_tp.py [--tp 2] [--steps 64] [--skip-moe] [--skip-speed]

For each model (seeded, initializer_range 0.02, Qwen3's own):
  1. float32, no CUDA graphs: greedy tokens of a mixed batch (6 prompts, lengths 5..200, two sharing a
     48-token prefix), --steps each, TP=N must equal TP=1 exactly (float32, so summation order cannot
     flip a near-tie),
     and a teacher-forced check: every prefix of the float32 TP=1 sequences is prefilled once
     (max_new_tokens 1, top-5 log-probs), giving the next-token log-probs at each of the 6 x steps
     positions; TP=N's must be within 1e-3 of TP=1's;
  2. bfloat16 (triton attention, CUDA graphs): the same greedy batch, tokens compared (first divergence
     reported), and the same teacher-forced positions. The bf16 tolerance is measured, not assumed:
     TP=1 bf16 against TP=1 float32. TP=N bf16 against TP=1 bf16 must be no further (numerics()).
Then, 8B bf16 only: decode speed at batch 1 (128-token prompt, 256 new tokens) and batch 64 (64 distinct
128-token prompts, 128 new each), prefill time subtracted; and the all-reduce of one decode step's
activations ([batch, hidden] bf16, two per layer) timed on CUDA events: NCCL, and PyTorch's
symmetric-memory one-shot all-reduce that tp_all_reduce uses (peer-to-peer loads; NVLink multicast
stays off), its sums compared to NCCL's (_allreduce_worker). A table closes the output; JSON goes to $OUT/gpu_tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import (  # noqa: E402
    OUT,
    SHAPES,
    build_checkpoint,
    build_moe_checkpoint,
    copy_bandwidth,
    weight_bytes,
)
from services.worker.frontend.engine import Engine  # noqa: E402

# The device's NCCL/PyTorch must not use NVLink multicast (KINDS.md); children inherit these.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
POOL = 65536
TOP = 5
GREEDY = {"temperature": 0, "ignore_eos": True}


def build_moe(layers: int = 4) -> Path:
    """Qwen3-30B-A3B's widths (hidden 2048, 128 experts top-8, expert width 768, 32 q / 4 kv heads) with
    `layers` layers, bf16, initializer_range 0.02."""
    return build_moe_checkpoint(
        f"a3b-{layers}l-bfloat16", torch.bfloat16, 0.02, vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        max_position_embeddings=40960,
    )


def mixed_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(10, vocab, (48,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (5, 200, 17, 90)]
    prompts += [shared + torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 30)]
    return prompts


def greedy(engine: Engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY | {"max_new_tokens": steps})
    return [o["output_ids"] for o in outs]


def forced_tops(engine: Engine, prompts: list[list[int]], seqs: list[list[int]]) -> list[dict[int, float]]:
    """Top-TOP next-token log-probs after every prefix prompt + seq[:j] (j < len(seq)), in order."""
    forced = [p + s[:j] for p, s in zip(prompts, seqs) for j in range(len(s))]
    outs = engine.generate(input_ids=forced, sampling_params=GREEDY | {"max_new_tokens": 1},
                           return_logprob=True, top_logprobs_num=TOP)
    return [{tid: lp for lp, tid, _ in o["meta_info"]["output_top_logprobs"][0]} for o in outs]


def decode_rate(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Decode tok/s of a batch: (time(steps) - time(1)) over (steps - 1) tokens per request."""
    def timed(n: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=GREEDY | {"max_new_tokens": n})
        return time.perf_counter() - t0

    timed(4)  # warm
    one, full = timed(1), timed(steps)
    return len(prompts) * (steps - 1) / max(full - one, 1e-9)


def run_model(path: Path, tp: int, dtype: str, prompts: list[list[int]], steps: int,
              seqs: list[list[int]] | str | None, speed: bool) -> dict[str, object]:
    """Greedy tokens; forced top log-probs along `seqs` (when given; "own": its greedy tokens); decode
    speeds (when `speed`)."""
    cuda = torch.cuda.is_available()  # the CPU runs only dry-run this script on a tiny checkpoint
    graphs = 64 if dtype == "bfloat16" and cuda else 0
    t0 = time.perf_counter()
    with Engine(str(path), tp_size=tp, dtype=dtype, max_total_tokens=POOL, cuda_graph_max_bs=graphs,
                attention_backend="triton" if cuda else "torch") as engine:
        out: dict[str, object] = {"tokens": greedy(engine, prompts, steps)}
        if seqs is not None:
            out["tops"] = forced_tops(engine, prompts, out["tokens"] if seqs == "own" else seqs)  # type: ignore[arg-type]
        if speed:
            g = torch.Generator().manual_seed(11)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            out["bs1_tok_s"] = decode_rate(engine, [torch.randint(10, vocab, (128,), generator=g).tolist()], 256)
            batch = [torch.randint(10, vocab, (128,), generator=g).tolist() for _ in range(64)]
            out["bs64_tok_s"] = decode_rate(engine, batch, 128)
    if cuda:
        torch.cuda.empty_cache()
    out["wall_s"] = time.perf_counter() - t0
    return out


def first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    steps = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    found = [s for s in steps if s is not None]
    return min(found) if found else None


def top_delta(a: list[dict[int, float]], b: list[dict[int, float]]) -> list[float]:
    """Per position: the largest |log-prob difference| over tokens in both top lists."""
    return [max((abs(x[t] - y[t]) for t in x.keys() & y.keys()), default=float("inf")) for x, y in zip(a, b)]


def argmax_flips(ref: list[dict[int, float]], other: list[dict[int, float]]) -> list[float]:
    """The reference's top-2 margin at each position where the two argmaxes differ."""
    flips = []
    for x, y in zip(ref, other):
        if max(x, key=x.get) != max(y, key=y.get):
            best = sorted(x.values(), reverse=True)
            flips.append(best[0] - best[1])
    return flips


def pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def numerics(name: str, path: Path, tp: int, steps: int, speed: bool, rows: list, results: dict) -> bool:
    """The float32 checks and the bf16 teacher-forced tolerance check of one model; True if all pass.

    float32: TP=N greedy tokens == TP=1's, and TP=N's forced log-probs within 1e-3 of TP=1's at every
    position. bf16: TP=N must be no further from TP=1 than bf16 itself is from float32 (the measured
    tolerance): the 90th percentile of the per-position |d logprob| within 2x, and at most 2x + 1 as
    many argmax flips. A strict per-position bound would fail MoE models for the wrong reason: a router
    near-tie (two experts' scores within bf16 rounding) can flip an expert choice under any
    perturbation, TP's summation order or bf16 itself, and change that position's distribution."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = mixed_prompts(vocab)
    f1 = run_model(path, 1, "float32", prompts, steps, "own", speed=False)
    seqs: list[list[int]] = f1["tokens"]  # type: ignore[assignment]
    fn = run_model(path, tp, "float32", prompts, steps, seqs, speed=False)
    div = first_divergence(seqs, fn["tokens"])  # type: ignore[arg-type]
    fp32_delta = max(top_delta(fn["tops"], f1["tops"]))  # type: ignore[arg-type]
    fp32_ok = div is None and fp32_delta <= 1e-3
    results[f"{name}_fp32_tokens_identical"] = div is None
    results[f"{name}_fp32_forced_max_delta"] = fp32_delta
    rows.append((f"{name} float32 TP={tp} vs TP=1: greedy 6 mixed prompts x {steps}; forced log-probs",
                 ("tokens identical" if div is None else f"tokens differ from step {div}")
                 + f"; max |d logprob| {fp32_delta:.1e} over {len(seqs) * steps} positions"))
    print(rows[-1], flush=True)
    b1 = run_model(path, 1, "bfloat16", prompts, steps, seqs, speed)
    bn = run_model(path, tp, "bfloat16", prompts, steps, seqs, speed)
    div = first_divergence(b1["tokens"], bn["tokens"])  # type: ignore[arg-type]
    results[f"{name}_bf16_greedy_identical"] = div is None
    results[f"{name}_bf16_first_divergence"] = div
    rows.append((f"{name} bf16 TP={tp} vs TP=1 greedy, 6 x {steps}",
                 "tokens identical" if div is None else f"tokens differ from step {div} (see the forced check)"))
    ref = top_delta(b1["tops"], f1["tops"])  # type: ignore[arg-type]
    tpd = top_delta(bn["tops"], b1["tops"])  # type: ignore[arg-type]
    flips = argmax_flips(b1["tops"], bn["tops"])  # type: ignore[arg-type]
    ref_flips = argmax_flips(f1["tops"], b1["tops"])  # type: ignore[arg-type]
    ok = pct(tpd, 0.9) <= 2 * pct(ref, 0.9) and len(flips) <= 2 * len(ref_flips) + 1
    results[f"{name}_bf16_forced"] = {
        "positions": len(ref), "pass": ok,
        "tp_vs_tp1": {"median": pct(tpd, 0.5), "p90": pct(tpd, 0.9), "max": max(tpd), "flips": len(flips),
                      "flip_margins": flips},
        "bf16_vs_fp32": {"median": pct(ref, 0.5), "p90": pct(ref, 0.9), "max": max(ref), "flips": len(ref_flips),
                         "flip_margins": ref_flips},
    }
    rows.append((f"{name} bf16 teacher-forced, {len(ref)} positions, |d logprob| over top-{TOP} median/p90/max",
                 f"TP={tp} vs TP=1 {pct(tpd, 0.5):.4f}/{pct(tpd, 0.9):.4f}/{max(tpd):.3f}, argmax flips {len(flips)}; "
                 f"tolerance (TP=1 bf16 vs fp32) {pct(ref, 0.5):.4f}/{pct(ref, 0.9):.4f}/{max(ref):.3f}, flips "
                 f"{len(ref_flips)}; {'PASS' if ok else 'FAIL'}"))
    print(rows[-1], flush=True)
    for tp_size, run in ((1, b1), (tp, bn)):
        results[f"{name}_bf16_tp{tp_size}"] = {k: v for k, v in run.items() if k.endswith(("tok_s", "wall_s"))}
    return fp32_ok and ok


def _allreduce_worker(rank: int, world: int, port: int, hidden: int, batches: list[int], result: object) -> None:
    """NCCL vs the engine's tp_all_reduce with FastAllReduce on: timings, and its sums checked against
    NCCL's on 256 back-to-back calls (fresh data each, no other collective between them, so a rank
    overwriting a buffer its peer still reads would show) and inside a CUDA graph of 2 x 36 calls."""
    from services.worker.runtime.distributed import destroy_tp, enable_fast_all_reduce, init_tp, tp_all_reduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    # A rank that fails leaves its peer in a collective: 120 s, not NCCL's 10 min, before that one
    # fails too. (A call whose run also captured NCCL all-reduces in a graph hung past its limit.)
    init_tp(rank, world, f"tcp://127.0.0.1:{port}", device, timeout_s=120)
    times: dict[str, object] = {}

    def timed(fn: object, iters: int = 200) -> float:
        for _ in range(20):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters * 1e3  # µs per call

    g = torch.Generator(device="cuda").manual_seed(rank)

    def inputs(n: int) -> list[torch.Tensor]:
        return [torch.randn((batches[i % len(batches)], hidden), dtype=torch.bfloat16, device="cuda", generator=g)
                for i in range(n)]

    def nccl_sums(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        wants = [x.clone() for x in xs]
        for w in wants:
            dist.all_reduce(w)
        return wants

    for bs in batches:
        x = torch.randn((bs, hidden), dtype=torch.bfloat16, device="cuda", generator=g)
        times[f"nccl_{bs}"] = timed(lambda x=x: dist.all_reduce(x))
    if enable_fast_all_reduce(torch.bfloat16, device):
        xs = inputs(256)
        wants = nccl_sums(xs)
        torch.cuda.synchronize()
        gots = [tp_all_reduce(x) for x in xs]
        times["fast_mismatches"] = sum(not torch.equal(a, b) for a, b in zip(gots, wants))
        xs = inputs(72)
        wants = nccl_sums(xs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [tp_all_reduce(x) for x in xs]
        graph.replay()
        torch.cuda.synchronize()
        times["fast_graph_mismatches"] = sum(not torch.equal(a, b) for a, b in zip(outs, wants))
        # Inside a graph there is no host cost per call: the device time of one all-reduce.
        times["symm_graph_1"] = timed(graph.replay, iters=20) / len(xs)
        for bs in batches:
            x = torch.randn((bs, hidden), dtype=torch.bfloat16, device="cuda", generator=g)
            times[f"symm_{bs}"] = timed(lambda x=x: tp_all_reduce(x))
    else:
        times["symm_error"] = "enable_fast_all_reduce returned False (see the log)"
    if rank == 0:
        result.update(times)  # type: ignore[attr-defined]
    destroy_tp()


def allreduce_us(world: int, hidden: int, batches: list[int]) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_allreduce_worker, args=(world, port, hidden, batches, result), nprocs=world, join=True)
        return dict(result)


def allreduce_rows(tp: int, rows: list, results: dict) -> None:
    hidden, layers = int(SHAPES["8b"]["hidden_size"]), int(SHAPES["8b"]["num_hidden_layers"])  # type: ignore[call-overload]
    us = allreduce_us(tp, hidden, [1, 64])
    results["allreduce"] = us
    for bs in (1, 64):
        for kind in ("nccl", "symm"):
            if f"{kind}_{bs}" not in us:
                continue
            t = float(us[f"{kind}_{bs}"])  # type: ignore[arg-type]
            equal = "" if kind == "nccl" else (f"; sums != NCCL's: {us.get('fast_mismatches')}/256 back to back, "
                                               f"{us.get('fast_graph_mismatches')}/72 in a CUDA graph")
            rows.append((f"{'NCCL all_reduce' if kind == 'nccl' else 'tp_all_reduce (symm-mem one-shot)'} "
                         f"[{bs}, {hidden}] bf16, {tp} GPUs, eager loop",
                         f"{t:.1f} us; x{2 * layers} per step = {2 * layers * t / 1e3:.2f} ms/step{equal}"))
    if "symm_graph_1" in us:
        t = float(us["symm_graph_1"])  # type: ignore[arg-type]
        rows.append((f"tp_all_reduce [1, {hidden}] bf16 in a CUDA graph of 72 (device time each)",
                     f"{t:.1f} us = {2 * layers * t / 1e3:.2f} ms/step"))
    if "symm_error" in us:
        rows.append(("symm-mem one_shot_all_reduce", str(us["symm_error"])))


def shutdown_check(tp: int, rows: list, results: dict) -> None:
    """Start, use and shut down a float32 TP engine (no graphs) on a small random Qwen3: the rank
    processes must exit without the parent's 30 s kill."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path("/tmp/rs-qwen3-small-tp-float32")
    if not (path / "config.json").exists():
        config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=64, initializer_range=0.02)
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(str(path))
    t0 = time.perf_counter()
    engine = Engine(str(path), tp_size=tp, dtype="float32", max_total_tokens=POOL, cuda_graph_max_bs=0)
    started = time.perf_counter()
    greedy(engine, mixed_prompts(32000), 8)
    t1 = time.perf_counter()
    engine.shutdown()
    stop = time.perf_counter() - t1
    results["shutdown_s"] = stop
    rows.append((f"small float32 TP={tp} engine: start / shut down", f"{started - t0:.1f} s / {stop:.1f} s"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="only the all-reduce figures and a TP engine's start/stop")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    OUT.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (OUT / "gpu_tp.json").write_text(json.dumps({"rows": rows, "results": results}, indent=1))

    ok = True
    if not args.quick:
        bw = copy_bandwidth()
        path = build_checkpoint("8b", torch.bfloat16, initializer_range=0.02)
        ceiling = bw / weight_bytes(path)
        rows.append(("device copy bandwidth (read+write), one GPU",
                     f"{bw / 1e9:.0f} GB/s; 8B bs1 ceiling {ceiling:.0f} tok/s"))
        ok = numerics("8b", path, args.tp, args.steps, not args.skip_speed, rows, results)
        save()
        if not args.skip_speed:
            for tp in (1, args.tp):
                r = results[f"8b_bf16_tp{tp}"]
                rows.append((f"Qwen3-8B bf16 TP={tp} decode", f"bs1 {r['bs1_tok_s']:.1f} tok/s ({r['bs1_tok_s'] / ceiling:.3f} "  # type: ignore[index]
                             f"of one GPU's ceiling); bs64 {r['bs64_tok_s']:.0f} tok/s"))  # type: ignore[index]
    if args.quick or not args.skip_speed:
        allreduce_rows(args.tp, rows, results)
        save()
    if args.quick:
        shutdown_check(args.tp, rows, results)
        save()
    elif not args.skip_moe:
        ok = numerics("moe", build_moe(), args.tp, args.steps // 2, False, rows, results) and ok
        save()
    print("\n| check / figure | result |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
