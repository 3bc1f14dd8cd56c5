"""The FP8 KV cache on one GPU (issue #26): --kv-cache-dtype fp8_e4m3 against the bfloat16 cache, on a
random Qwen3-8B-shaped bfloat16 checkpoint (initializer_range 0.02: activations in a trained model's
range; no weights can be downloaded on the device machine).

    python bench/gpu_fp8_kv.py [--kv-dtypes auto,fp8_e4m3,fp8_e5m2] [--steps 128] [--skip-capacity-run]

Checks (the script exits 1 if one fails):
  1. kernels at the 8B attention shape (32 q heads, 8 KV heads, head_dim 128, bfloat16 activations):
     store_kv and the fused q/k-norm + RoPE + store write the float8 bits torch's quantization gives
     (x * (1 / scale), clipped, nearest even: the interpreter tests' contract holds on the GPU's cvt);
     decode and extend attention over a float8 pool are as close to the float32 reference over the
     dequantized pool as the same kernels over a bfloat16 pool holding those values.
Runtime: two engine starts (CUDA graphs), the capacity runs prefill ~0.7M (bf16) and ~1.4M (fp8) prompt
tokens; --skip-capacity-run leaves them out.
Figures, per KV dtype, all at the same --mem-fraction-static:
  - KV pool tokens; max concurrent 4k-token requests, derived (pool // (4096 + --out-len)) and, unless
    --skip-capacity-run, measured (peak running requests while derived + 16 such requests are served;
    the scheduler admits on a reservation, so a peak above what fits to the end shows as retractions);
  - prompt log-prob difference against the bfloat16 cache (8 prompts x 512 tokens), greedy agreement
    over 64 new tokens (positions before the first difference);
  - decode throughput at batch 64 (prompts of --context tokens, --steps new tokens) beside its ceiling
    (weights + the batch's K/V bytes read per step, over the measured copy bandwidth);
  - the decode attention kernel alone, batch 64 x --context: time per call and K/V bytes read per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, SHAPES, build_checkpoint, copy_bandwidth, weight_bytes  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    alloc_decode_partials,
    alloc_split_counters,
    decode_attention,
    kv_splits_per_request,
    max_kv_splits_for,
)
from kernels.extend_attention import ExtendTiles, alloc_extend_partials, extend_attention, extend_block_table  # noqa: E402
from kernels.kv_store import store_kv  # noqa: E402
from kernels.qk_norm_rope import qk_norm_rope_  # noqa: E402
from kernels.reference import decode_attention_ref, extend_attention_ref, kv_store_ref, pool_values_ref  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402
from services.worker.mem.memory_pool import FP8_KV_DTYPES, TokenToKVPool  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEVICE = "cuda"
N_STORE = 4096  # tokens of the store checks
REQUEST_LEN = 4096  # prompt tokens of the capacity figure's requests
SCORED_LEN = 512  # prompt tokens of the log-prob comparison
VOCAB = 150000
BF16 = torch.bfloat16


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def paged_pool(
    gen: torch.Generator, seq_lens: list[int], dtype: torch.dtype, scales: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_buffer, v_buffer, req_to_token, req_pool_indices): random values stored as `dtype` with these
    scales, each request's positions on shuffled slots."""
    total = sum(seq_lens)
    shape = (total + 1, KV_HEADS, HEAD_DIM)
    k = pool_values_ref(torch.randn(shape, generator=gen, device=DEVICE) * 2, dtype, scales[0])
    v = pool_values_ref(torch.randn(shape, generator=gen, device=DEVICE) * 2, dtype, scales[1])
    table = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int32, device=DEVICE)
    slots = torch.randperm(total, generator=gen, device=DEVICE) + 1
    start = 0
    for i, n in enumerate(seq_lens):
        table[i, :n] = slots[start : start + n].to(torch.int32)
        start += n
    return k, v, table, torch.arange(len(seq_lens), device=DEVICE)


def as_bf16_pool(buffer: torch.Tensor, scale: float) -> torch.Tensor:
    """The float8 pool's values, dequantized, as a bfloat16 pool (exact: power-of-two scales)."""
    return (buffer.float() * scale).to(BF16)


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def decode_launcher(q, table, rows, seq_lens):  # noqa: ANN001, ANN201 - a closure over its buffers
    """decode_attention over a pool, its scratch and split counts made once (so a timed call is the
    kernel alone)."""
    bs = q.shape[0]
    splits_max = max_kv_splits_for(bs, KV_HEADS, num_sms())
    splits = kv_splits_per_request(seq_lens, splits_max)
    part_out, part_lse = alloc_decode_partials(bs, HEADS, splits_max, HEAD_DIM, DEVICE)
    out = torch.empty_like(q)
    counters = alloc_split_counters(bs, KV_HEADS, DEVICE)

    def launch(k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return decode_attention(
            q, k, v, out, table, rows, seq_lens, splits, splits_max, HEAD_DIM**-0.5, part_out, part_lse,
            split_counters=counters, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    return launch


def decode_run(q, k, v, table, rows, seq_lens, k_scale=1.0, v_scale=1.0) -> torch.Tensor:  # noqa: ANN001
    return decode_launcher(q, table, rows, seq_lens)(k, v, k_scale, v_scale).clone()


def kernel_checks(name: str, dtype: torch.dtype, context: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scales = (0.5, 2.0)  # powers of two: a float8 value times either is exact in bfloat16
    # Stores: the plain kernel and the fused prologue, with values past the float8 range among them.
    n = N_STORE
    k = torch.randn((n, KV_HEADS * HEAD_DIM), generator=gen, device=DEVICE) * 3
    k.view(-1)[::97] *= 400
    k, v = k.to(BF16), (k.flip(0) * 0.7).to(BF16)
    loc = torch.randperm(n, generator=gen, device=DEVICE) + 1
    kb, vb = (torch.zeros((n + 1, KV_HEADS, HEAD_DIM), dtype=dtype, device=DEVICE) for _ in range(2))
    rk, rv = torch.zeros_like(kb), torch.zeros_like(vb)
    store_kv(kb, vb, loc, k, v, *scales)
    kv_store_ref(rk, rv, loc, k, v, *scales)
    store_bits = torch.equal(kb.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(
        vb.view(torch.uint8), rv.view(torch.uint8)
    )
    q = torch.randn((n, HEADS * HEAD_DIM), generator=gen, device=DEVICE).to(BF16)
    freqs = torch.outer(
        torch.arange(8192, device=DEVICE).float(),
        1e6 ** -(torch.arange(0, HEAD_DIM, 2, device=DEVICE) / HEAD_DIM),
    )
    weight = (1 + 0.3 * torch.randn(HEAD_DIM, generator=gen, device=DEVICE)).to(BF16)
    kb.zero_(), vb.zero_(), rk.zero_(), rv.zero_()
    qk_norm_rope_(
        torch.randint(0, 8192, (n,), generator=gen, device=DEVICE), q, k, freqs.cos(), freqs.sin(), HEAD_DIM,
        q_weight=weight, k_weight=weight, v=v, k_buffer=kb, v_buffer=vb, out_cache_loc=loc, k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
    kv_store_ref(rk, rv, loc, k, v, *scales)  # k: rotated in place
    fused_bits = torch.equal(kb.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(
        vb.view(torch.uint8), rv.view(torch.uint8)
    )
    # Decode at batch 64 with mixed lengths up to `context`.
    seq_lens_list = torch.randint(context // 4, context + 1, (64,), generator=gen, device=DEVICE).tolist()
    k8, v8, table, rows = paged_pool(gen, seq_lens_list, dtype, scales)
    seq_lens = torch.tensor(seq_lens_list, device=DEVICE)
    q = torch.randn((64, HEADS * HEAD_DIM), generator=gen, device=DEVICE).to(BF16)
    ref = decode_attention_ref(q, k8, v8, table, rows, seq_lens, HEAD_DIM**-0.5, *scales)
    fp8_err = rel_error(decode_run(q, k8, v8, table, rows, seq_lens, *scales), ref)
    k16, v16 = as_bf16_pool(k8, scales[0]), as_bf16_pool(v8, scales[1])
    bf16_err = rel_error(decode_run(q, k16, v16, table, rows, seq_lens), ref)
    # Extend: fresh prompts and chunks after cached prefixes, in one launch.
    prefix, ext = [0, context // 4, context // 2, 3 * context // 4], [context // 8, context // 16, 33, 1]
    k8, v8, table, rows = paged_pool(gen, [p + e for p, e in zip(prefix, ext)], dtype, scales)
    tokens = sum(ext)
    q = torch.randn((tokens, HEADS * HEAD_DIM), generator=gen, device=DEVICE).to(BF16)
    kn = (torch.randn((tokens, KV_HEADS * HEAD_DIM), generator=gen, device=DEVICE) * 2).to(BF16)
    vn = (torch.randn((tokens, KV_HEADS * HEAD_DIM), generator=gen, device=DEVICE) * 2).to(BF16)
    tiles = ExtendTiles()
    table_blocks = extend_block_table(prefix, ext, tiles.block_m).to(DEVICE)
    indptr = torch.tensor([0, *ext], device=DEVICE).cumsum(0).to(torch.int32)
    prefix_t = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    extend_attention(
        q, kn, vn, out, k8, v8, table, rows, prefix_t, indptr, table_blocks, HEAD_DIM**-0.5, tiles,
        alloc_extend_partials(1, HEADS, tiles.block_m, HEAD_DIM, DEVICE), k_scale=scales[0], v_scale=scales[1],
    )  # fmt: skip
    ext_ref = extend_attention_ref(q, kn, vn, k8, v8, table, rows, prefix, ext, HEAD_DIM**-0.5, *scales)
    ext_err = rel_error(out, ext_ref)
    ok = store_bits and fused_bits and fp8_err <= 1.5 * bf16_err + 1e-3 and ext_err < 2e-2
    return {
        "kv_dtype": name, "store_bits_equal": store_bits, "fused_store_bits_equal": fused_bits,
        "decode_rel_err": fp8_err, "decode_rel_err_bf16_pool": bf16_err, "extend_rel_err": ext_err, "ok": ok,
    }  # fmt: skip


def time_decode_kernel(dtype: torch.dtype, context: int) -> tuple[float, float]:
    """(seconds per decode_attention call, K/V bytes read per second) at batch 64, all `context` long."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    seq_lens_list = [context] * 64
    k, v, table, rows = paged_pool(gen, seq_lens_list, dtype, (1.0, 1.0))
    seq_lens = torch.tensor(seq_lens_list, device=DEVICE)
    q = torch.randn((64, HEADS * HEAD_DIM), generator=gen, device=DEVICE).to(BF16)
    launch = decode_launcher(q, table, rows, seq_lens)
    for _ in range(3):
        launch(k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        launch(k, v)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    kv_bytes = 64 * context * TokenToKVPool.bytes_per_token(1, KV_HEADS, HEAD_DIM, dtype)
    return seconds, kv_bytes / seconds


def prompts_of(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (length,), generator=gen).tolist() for _ in range(count)]


def peak_running(engine: Engine, count: int, out_len: int) -> tuple[int, int]:
    """Serve `count` REQUEST_LEN-token requests at once; (most running at one time, retractions)."""
    peak, done = 0, threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, engine.get_server_info()["num_running"])
            time.sleep(0.1)

    before = engine.get_server_info()["stats"]["num_retractions"]
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        engine.generate(
            input_ids=prompts_of(count, REQUEST_LEN, seed=11),
            sampling_params={"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True},
        )
    finally:
        done.set()
        poller.join()
    return peak, engine.get_server_info()["stats"]["num_retractions"] - before


def engine_figures(path: Path, kv: str, args: argparse.Namespace, bandwidth: float) -> dict:
    result: dict = {"kv_dtype": kv}
    with Engine(
        str(path),
        kv_cache_dtype=kv,
        mem_fraction_static=args.mem_fraction,
        max_running_requests=args.max_running,
    ) as engine:
        info = engine.get_server_info()
        pool = info["max_total_tokens"]
        result.update(pool_tokens=pool, pool_dtype=info["kv_cache_dtype"])
        result["max_4k_requests_derived"] = min(
            pool // (REQUEST_LEN + args.out_len), info["max_running_requests"]
        )
        scored_prompts = prompts_of(8, SCORED_LEN, seed=3)
        scored = engine.generate(
            input_ids=scored_prompts, sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True, logprob_start_len=0,
        )  # fmt: skip
        result["prompt_logprobs"] = [
            [lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in scored
        ]
        greedy = engine.generate(
            input_ids=scored_prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        )
        result["greedy"] = [r["output_ids"] for r in greedy]
        # Decode at batch 64: prompts cached by a first pass, so both timed runs prefill one token each.
        batch = prompts_of(64, args.context, seed=7)
        one = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
        engine.generate(input_ids=batch, sampling_params=one)
        t0 = time.perf_counter()
        engine.generate(input_ids=batch, sampling_params=one)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate(input_ids=batch, sampling_params={**one, "max_new_tokens": 1 + args.steps})
        decode = time.perf_counter() - t0 - prefill
        tok_s = 64 * args.steps / decode
        kv_per_step = (
            64
            * (args.context + args.steps / 2)
            * TokenToKVPool.bytes_per_token(
                SHAPES["8b"]["num_hidden_layers"], KV_HEADS, HEAD_DIM, FP8_KV_DTYPES.get(kv, BF16)
            )
        )
        ceiling = 64 * bandwidth / (weight_bytes(path) + kv_per_step)
        result.update(decode_tok_s=tok_s, decode_ceiling_tok_s=ceiling, decode_ratio=tok_s / ceiling)
        if not args.skip_capacity_run:
            engine.flush_cache()
            peak, retractions = peak_running(engine, result["max_4k_requests_derived"] + 16, args.out_len)
            result.update(max_4k_requests_measured=peak, capacity_run_retractions=retractions)
    return result


def compare(ours: dict, base: dict) -> dict:
    diffs = [
        abs(a - b) for xs, ys in zip(ours["prompt_logprobs"], base["prompt_logprobs"]) for a, b in zip(xs, ys)
    ]
    agreed = sum(
        next((i for i, (a, b) in enumerate(zip(xs, ys)) if a != b), len(xs))
        for xs, ys in zip(ours["greedy"], base["greedy"])
    ) / sum(len(xs) for xs in base["greedy"])
    return {
        "logprob_diff_mean": sum(diffs) / len(diffs),
        "logprob_diff_max": max(diffs),
        "greedy_agreement": agreed,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="auto,fp8_e4m3", help="the first is the baseline")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--max-running", type=int, default=1024)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of the batch-64 decode runs")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=16, help="new tokens per 4k-token request (capacity)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-capacity-run", action="store_true")
    ap.add_argument(
        "--kernels-only", action="store_true", help="the kernel checks and timings, no engine runs"
    )
    args = ap.parse_args()
    kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    rows: list[tuple[str, str]] = []
    results: dict = {"args": vars(args)}
    ok = True
    bandwidth = copy_bandwidth()
    rows.append(("device copy bandwidth (read+write)", f"{bandwidth / 1e9:.0f} GB/s"))
    if not args.skip_kernels:
        for kv in [k for k in kv_dtypes if k != "auto"]:
            check = kernel_checks(kv, FP8_KV_DTYPES[kv], args.context)
            results[f"kernels_{kv}"] = check
            ok &= check["ok"]
            rows.append((f"{kv} kernels: store/fused-store bits == torch", f"{check['store_bits_equal']}/"
                         f"{check['fused_store_bits_equal']}"))  # fmt: skip
            rows.append((f"{kv} decode rel err (bf16 pool, same values)",
                         f"{check['decode_rel_err']:.2e} ({check['decode_rel_err_bf16_pool']:.2e})"))  # fmt: skip
            rows.append((f"{kv} extend rel err", f"{check['extend_rel_err']:.2e}"))
        for kv in kv_dtypes:
            seconds, rate = time_decode_kernel(FP8_KV_DTYPES.get(kv, BF16), args.context)
            results[f"decode_kernel_{kv}"] = {"us_per_call": seconds * 1e6, "kv_bytes_per_s": rate}
            rows.append((f"decode kernel bs64 x {args.context} ({kv})",
                         f"{seconds * 1e6:.0f} us; K/V {rate / 1e9:.0f} GB/s ({rate / bandwidth:.2f} of copy bw)"))  # fmt: skip
    figures = {}
    path = None if args.kernels_only else build_checkpoint("8b", BF16, initializer_range=0.02)
    for kv in kv_dtypes if path is not None else []:
        t0 = time.perf_counter()
        figures[kv] = engine_figures(path, kv, args, bandwidth)
        print(f"  engine figures for {kv} in {time.perf_counter() - t0:.0f} s", flush=True)
        if os.environ.get("OUT"):  # kept if the run is cut off by its time limit
            OUT.mkdir(parents=True, exist_ok=True)
            partial = {
                k: {n: v for n, v in f.items() if n not in ("prompt_logprobs", "greedy")}
                for k, f in figures.items()
            }
            (OUT / "gpu_fp8_kv_partial.json").write_text(
                json.dumps({"rows": rows, "engine": partial}, indent=2)
            )
    base = figures.get(kv_dtypes[0])
    for kv, fig in figures.items():
        summary = {k: v for k, v in fig.items() if k not in ("prompt_logprobs", "greedy")}
        if kv != kv_dtypes[0]:
            summary.update(compare(fig, base))
        results[f"engine_{kv}"] = summary
        rows.append((f"{kv}: KV pool tokens ({fig['pool_dtype']})", f"{fig['pool_tokens']} "
                     f"({fig['pool_tokens'] / base['pool_tokens']:.2f}x {kv_dtypes[0]})"))  # fmt: skip
        measured = fig.get("max_4k_requests_measured")
        rows.append((f"{kv}: max concurrent 4k-token requests", f"{fig['max_4k_requests_derived']} derived"
                     + (f", {measured} measured ({fig['capacity_run_retractions']} retractions)" if measured else "")))  # fmt: skip
        rows.append((f"{kv}: decode bs64 x {args.context} tok/s", f"{fig['decode_tok_s']:.0f}; ceiling "
                     f"{fig['decode_ceiling_tok_s']:.0f}; ratio {fig['decode_ratio']:.2f}"))  # fmt: skip
        if kv != kv_dtypes[0]:
            rows.append((f"{kv} vs {kv_dtypes[0]}: prompt log-prob |diff| mean / max",
                         f"{summary['logprob_diff_mean']:.4f} / {summary['logprob_diff_max']:.4f}"))  # fmt: skip
            rows.append(
                (
                    f"{kv} vs {kv_dtypes[0]}: greedy agreement (64 tokens x 8)",
                    f"{summary['greedy_agreement']:.0%}",
                )
            )
    results["ok"] = ok
    if os.environ.get("OUT"):
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_fp8_kv.json").write_text(json.dumps({"rows": rows, "results": results}, indent=2))
    print("\n== gpu_fp8_kv ==")
    for k, v in rows:
        print(f"{k:60s} {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
