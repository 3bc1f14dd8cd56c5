"""Tensor parallelism on several GPUs of one host (NCCL): TP=2 against TP=1 on random-init
Qwen3-8B-shaped and small Qwen3-MoE models (no weights can be downloaded there).

    python bench/gpu_tp.py [--tp 2] [--steps 64]

First the token check in float32 (the bf16 checkpoint upcast, no CUDA graphs, so it is quick): a
mixed batch of 6 prompts (lengths 5..200, two sharing a 48-token prefix), greedy, --steps tokens
each, with the log-probabilities of the chosen tokens; TP>1 must give the TP=1 tokens (float32, so
summation order cannot flip a near-tie). Then, for each TP size, one bf16 Engine (triton attention,
CUDA graphs up to batch 64) runs the same batch (tokens compared, log-probs in bf16 tolerance), then
  1. batch-1 decode speed (128-token prompt, 256 new tokens; prefill time subtracted);
  2. batch-64 decode speed (64 distinct 128-token prompts, 128 new tokens each). The all-reduce cost is measured apart: NCCL all_reduce of one decode step's
activations ([batch, hidden] bf16), two per layer, timed over CUDA events on every rank. The small
Qwen3-MoE (fp32) is checked the same way for tokens. A table closes the output; JSON goes to
$OUT/gpu_tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, SHAPES, build_checkpoint, copy_bandwidth, weight_bytes  # noqa: E402
from bench.gpu_cuda_graph import build_moe_checkpoint  # noqa: E402
from services.worker.engine import Engine  # noqa: E402

POOL = 65536


def mixed_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(10, vocab, (48,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (5, 200, 17, 90)]
    prompts += [shared + torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 30)]
    return prompts


def greedy(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[float]]]:
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": steps, "ignore_eos": True},
        return_logprob=True,
    )
    return [o["output_ids"] for o in outs], [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def decode_rate(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Decode tok/s of a batch: (time(steps) - time(1)) over (steps - 1) tokens per request."""
    def timed(n: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
        return time.perf_counter() - t0

    timed(4)  # warm
    one, full = timed(1), timed(steps)
    return len(prompts) * (steps - 1) / max(full - one, 1e-9)


def run_model(path: Path, tp: int, steps: int, dtype: str, speed: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    graphs = 64 if speed else 0
    with Engine(str(path), tp_size=tp, dtype=dtype, max_total_tokens=POOL, cuda_graph_max_bs=graphs,
                attention_backend="triton") as engine:
        tokens, logprobs = greedy(engine, mixed_prompts(vocab), steps)
        out: dict[str, object] = {"tokens": tokens, "logprobs": logprobs}
        if speed:
            out["bs1_tok_s"] = decode_rate(engine, [torch.randint(10, vocab, (128,), generator=g).tolist()], 256)
            batch = [torch.randint(10, vocab, (128,), generator=g).tolist() for _ in range(64)]
            out["bs64_tok_s"] = decode_rate(engine, batch, 128)
    torch.cuda.empty_cache()
    return out


def _allreduce_worker(rank: int, world: int, port: int, hidden: int, batches: list[int], result: object) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = {}
    for bs in batches:
        x = torch.randn((bs, hidden), dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        times[bs] = start.elapsed_time(end) / 200 * 1e3  # µs per all-reduce
    if rank == 0:
        result.update(times)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def allreduce_us(world: int, hidden: int, batches: list[int]) -> dict[int, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_allreduce_worker, args=(world, port, hidden, batches, result), nprocs=world, join=True)
        return dict(result)


def compare(base: dict[str, object], other: dict[str, object]) -> tuple[bool, float, int | None]:
    same = base["tokens"] == other["tokens"]
    first = None
    if not same:
        diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(base["tokens"], other["tokens"])]  # type: ignore[arg-type]
        first = min(d for d in diffs if d is not None)
    deltas = [abs(a - b) for xs, ys, tx, ty in zip(base["logprobs"], other["logprobs"], base["tokens"], other["tokens"])
              for a, b, ta, tb in zip(xs, ys, tx, ty) if ta == tb]  # type: ignore[arg-type]
    return same, max(deltas, default=0.0), first


def token_check(base: dict[str, object], other: dict[str, object]) -> tuple[bool, float, str]:
    """compare(), and its table cell."""
    same, delta, first = compare(base, other)
    text = f"tokens identical: {same}" + ("" if same else f" (first divergence at step {first})")
    return same, delta, text + f"; max |d logprob| (equal tokens) {delta:.2e}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip-moe", action="store_true")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    rows: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    OUT.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (OUT / "gpu_tp.json").write_text(json.dumps({"rows": rows, "results": results}, indent=1))

    bw = copy_bandwidth()
    path = build_checkpoint("8b", torch.bfloat16)
    ceiling = bw / weight_bytes(path)
    rows.append(("device copy bandwidth (read+write), one GPU", f"{bw / 1e9:.0f} GB/s; 8B bs1 ceiling {ceiling:.0f} tok/s"))
    fp32 = {tp: run_model(path, tp, args.steps, "float32", speed=False) for tp in (1, args.tp)}
    same, _, cell = token_check(fp32[1], fp32[args.tp])
    results["8b_fp32_tokens_identical"] = same
    rows.append((f"Qwen3-8B float32 TP={args.tp} vs TP=1, 6 mixed prompts x {args.steps} greedy", cell))
    print(rows[-1], flush=True)
    save()
    runs = {}
    for tp in (1, args.tp):
        t0 = time.perf_counter()
        runs[tp] = run_model(path, tp, args.steps, "bfloat16", speed=True)
        r = runs[tp]
        results[f"8b_tp{tp}"] = {k: v for k, v in r.items() if k.endswith("tok_s")} | {"wall_s": time.perf_counter() - t0}
        rows.append((f"Qwen3-8B bf16 TP={tp} decode", f"bs1 {r['bs1_tok_s']:.1f} tok/s ({r['bs1_tok_s'] / ceiling:.3f} of "
                     f"one GPU's ceiling); bs64 {r['bs64_tok_s']:.0f} tok/s"))
        print(rows[-1], flush=True)
        save()
    same, delta, cell = token_check(runs[1], runs[args.tp])
    results["8b_tokens_identical"] = same
    results["8b_max_logprob_delta"] = delta
    rows.append((f"Qwen3-8B bf16 TP={args.tp} vs TP=1, 6 mixed prompts x {args.steps} greedy", cell))
    print(rows[-1], flush=True)
    save()

    hidden = SHAPES["8b"]["hidden_size"]
    layers = SHAPES["8b"]["num_hidden_layers"]
    us = allreduce_us(args.tp, hidden, [1, 64])
    for bs, t in sorted(us.items()):
        per_step = 2 * layers * t / 1e3
        results[f"allreduce_bs{bs}_us"] = t
        rows.append((f"NCCL all_reduce [{bs}, {hidden}] bf16 over {args.tp} GPUs",
                     f"{t:.1f} us; x{2 * layers} per step = {per_step:.2f} ms/step"))
    save()

    if not args.skip_moe:
        moe = build_moe_checkpoint()
        base = run_model(moe, 1, 32, "float32", speed=False)
        other = run_model(moe, args.tp, 32, "float32", speed=False)
        same, _, cell = token_check(base, other)
        results["moe_tokens_identical"] = same
        rows.append((f"Qwen3-MoE small fp32 TP={args.tp} vs TP=1, 6 prompts x 32 greedy", cell))
        save()

    print("\n| check / figure | result |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0 if results["8b_fp32_tokens_identical"] and results.get("moe_tokens_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
