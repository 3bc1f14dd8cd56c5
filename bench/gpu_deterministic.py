"""--enable-deterministic-inference on one GPU: is a request's output the same alone, batched, chunked and
from the prefix cache, and what does the mode cost?

    python bench/gpu_deterministic.py [--requests 64] [--new-tokens 48] [--scale 1.0] [--skip-throughput]
                                      [--skip-pipeline]   (part 4 needs .whl-pipeline/: bench/gpu_pipeline.py)
    .venv/bin/python bench/gpu_deterministic.py --tiny  (part 4 alone on this CPU: a smoke run, ~1 minute)

1. Kernels (bf16, Qwen3-8B shapes): kernels/batch_invariant.py's product, each of a few rows alone vs in
   batches of 3 / 17 / 64 / 256 (bitwise), with cuBLAS (F.linear) beside it as the control, and its error
   against a float32 product; its time over cuBLAS's at M = 1, 64, 256, 2048 for the default tiles and
   --tiles alternatives (BM/BN/BK/warps/stages), to choose DEFAULT_TILES.
1b. Extend attention (bf16, the 0.6B and 8B head shapes): kernels/token_block_attention.py, a request's
   new tokens sharing key tiles, against decode attention run for each token (the batch-invariant decode
   kernel with fixed 1,024-key splits, which the extend path used to be), bitwise, over requests whose new
   tokens start at varied positions and cross split boundaries; and both timed on a 2,048-token prompt
   and on 16 x 128 new tokens after 1,000-token prefixes (--skip-attention leaves it out).
2. Outputs (Qwen3-8B-shaped random bf16 checkpoint, triton backend, CUDA graphs on): --requests prompts of
   64..1024 tokens, --new-tokens each, even requests greedy and odd ones sampled with a seed (temperature
   0.7, top-p 0.9). Runs: each request alone; all batched (chunked_prefill_size 8192: no chunking); all
   batched with 128-token chunks; all again with their prompts in the prefix cache. Counted: outputs
   identical to the lone run's, with and without the flag.
3. Throughput cost on bench/gpu_serving.py's P3 (nano-vllm's recipe: 256 requests, input and output
   uniform in [100, 1024], Qwen3-0.6B-shaped bf16), flag off vs on. Goal: the mode keeps >= 0.8 of it.
4. Pipeline: part 2's kind of requests (64..1024 ids, within the SmolLM2 vocabulary, the same sampling)
   through the services: `radixserve up` (bench/pipeline_overhead.py's Stack) on bench/gpu_pipeline.py's
   checkpoint (Qwen3-0.6B-shaped bf16 with the SmolLM2 tokenizer, which the tokenizer service and the
   detokenizer load), all at once as native /generate calls, then again with their prompts cached;
   counted: outputs identical to the same checkpoint's lone Engine runs, with and without the flag (on
   both sides). --tiny: this part alone on the CPU with gpu_pipeline.py's 2-layer checkpoint (bf16, torch
   attention), 8 requests of <= 128 ids.
Prints a table last; writes $OUT/gpu_deterministic.json after every part (a run cut off by its time
limit keeps what it measured; --skip-kernels / --skip-outputs / --skip-throughput / --skip-pipeline split
it into calls).
Exit 1 if the batch-invariant product or the deterministic runs are not all identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.gpu_common import OUT, build_checkpoint, copy_bandwidth, matmul_rate  # noqa: E402
from bench.gpu_serving import p3, rand_ids  # noqa: E402
from kernels.batch_invariant import MatmulTiles, matmul, tiles_for  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402
from shared.progress import say  # noqa: E402

# Qwen3-8B's products (N, K): qkv, o_proj, gate_up, down, LM head.
SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
# The 0.6B model's (P3's): qkv, o, gate_up, down; o and down take a split over K (tiles_for).
SHAPES_06B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


def kernel_check() -> dict:
    """Per shape: rows (of 8 sampled) that differ between alone and batched, batch-invariant vs cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {}
    for n, k in SHAPES_8B + SHAPES_06B:
        w = (torch.randn((n, k), generator=g, device="cuda") * 0.02).bfloat16()
        x = torch.randn((256, k), generator=g, device="cuda").bfloat16()
        counts = {"batch_invariant": 0, "cublas": 0}
        for i in (0, 1, 2, 16, 17, 63, 100, 255):
            for name, product in (("batch_invariant", matmul), ("cublas", F.linear)):
                alone = product(x[i : i + 1], w)[0]
                for bs in (3, 17, 64, 256):
                    start = i // bs * bs
                    if not torch.equal(product(x[start : start + bs], w)[i - start], alone):
                        counts[name] += 1
                        break
        ref = x.float() @ w.float().t()
        err = ((matmul(x, w).float() - ref).norm() / ref.norm()).item()
        out[f"{n}x{k}"] = {"rows_differing_of_8": counts, "rel_err_vs_fp32": err}
        del w, x, ref
    torch.cuda.empty_cache()
    return out


def kernel_speed(alternatives: list[MatmulTiles]) -> dict:
    """ms of the batch-invariant product / ms of cuBLAS's, per launch variant, shape and M (bf16). Variants:
    tiles_for's shape as launched; with its K split forced into the grid or into one program (the same
    arithmetic: matmul chooses by the output tile count); with 128-row tiles (4 or 8 warps), whose rows
    are each the same walk over K as in 64-row tiles if the tensor-core instruction is the same (checked
    bitwise: `block_m_equal`); and --tiles alternatives (no split)."""
    import dataclasses

    import triton.testing

    out: dict = {"ms": {}, "block_m_equal": {}}
    for n, k in SHAPES_8B[:4] + SHAPES_06B:
        w = torch.randn((n, k), device="cuda").bfloat16()
        auto = tiles_for(n, k)
        variants: list[tuple[str, MatmulTiles | None, bool | None]] = [("per shape (tiles_for)", None, None)]
        if auto.split_k > 1:
            variants += [("tiles_for, split in the grid", auto, False), ("tiles_for, split in one program", auto, True)]
        wide8 = dataclasses.replace(auto, block_m=128, num_warps=8)
        wide4 = dataclasses.replace(auto, block_m=128, num_warps=4)
        variants += [("tiles_for, 128 rows, 8 warps", wide8, None), ("tiles_for, 128 rows, 4 warps", wide4, None)]
        variants += [
            (f"{t.block_m}/{t.block_n}/{t.block_k}/{t.num_warps}/{t.num_stages}", t, None) for t in alternatives
        ]
        for m in (1, 64, 256, 2048, 8192):
            x = torch.randn((m, k), device="cuda").bfloat16()
            base = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w))
            out["ms"].setdefault("cuBLAS", {})[f"{n}x{k} M={m}"] = base
            for label, tiles, in_program in variants:
                ms = triton.testing.do_bench(
                    lambda x=x, w=w, t=tiles, p=in_program: matmul(x, w, tiles=t, splits_in_program=p)
                )
                out.setdefault(label, {})[f"{n}x{k} M={m}"] = ms / base
                out["ms"].setdefault(label, {})[f"{n}x{k} M={m}"] = ms
            if m >= 256:
                ref = matmul(x, w)
                out["block_m_equal"][f"{n}x{k} M={m}"] = {
                    "8 warps": torch.equal(matmul(x, w, tiles=wide8), ref),
                    "4 warps": torch.equal(matmul(x, w, tiles=wide4), ref),
                }
        del w
    return out


EXTEND_SPLIT = 1024


def _extend_case(g: torch.Generator, heads: int, k_buf: torch.Tensor, v_buf: torch.Tensor, requests: list[tuple[int, int]]):  # noqa: ANN202
    """Extend attention over random pool slots for (prefix, new tokens) per request: the per-token decode
    launch and the token-block launch, as two callables returning their outputs."""
    import triton

    from kernels.decode_attention import WIDE_BATCH_TILES, decode_attention, fixed_size_kv_splits
    from kernels.token_block_attention import token_block_attention, token_blocks, tokens_per_block

    slots, kv_heads, dim = k_buf.shape
    table = torch.zeros((len(requests), max(p + n for p, n in requests)), dtype=torch.int32, device="cuda")
    perm = torch.randperm(slots, generator=g, device="cuda").to(torch.int32)
    used, rows, lens = 0, [], []
    for r, (prefix, new) in enumerate(requests):
        table[r, : prefix + new] = perm[used : used + prefix + new]
        used += prefix + new
        rows += [r] * new
        lens += list(range(prefix + 1, prefix + new + 1))
    req_rows = torch.tensor(rows, dtype=torch.int64, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int64, device="cuda")
    splits = fixed_size_kv_splits(seq_lens, EXTEND_SPLIT)
    max_splits = triton.next_power_of_2(max(1, -(-max(lens) // EXTEND_SPLIT)))
    q = torch.randn((len(lens), heads * dim), generator=g, device="cuda").bfloat16()
    news = [n for _, n in requests]
    qo = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], device="cuda")
    per = tokens_per_block(heads, kv_heads)
    first, count = token_blocks(qo, sum(-(-n // per) for n in news), per)
    part_out = torch.empty((len(lens), heads, max_splits, dim), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((len(lens), heads, max_splits), dtype=torch.float32, device="cuda")

    def per_token() -> torch.Tensor:
        o = torch.empty_like(q)
        decode_attention(q, k_buf, v_buf, o, table, req_rows, seq_lens, splits, max_splits, dim**-0.5,
                         part_out, part_lse, WIDE_BATCH_TILES, split_tokens=EXTEND_SPLIT)  # fmt: skip
        return o

    def blocks() -> torch.Tensor:
        o = torch.empty_like(q)
        token_block_attention(q, k_buf, v_buf, o, table, req_rows, seq_lens, splits, first, count, max_splits,
                              dim**-0.5, EXTEND_SPLIT, WIDE_BATCH_TILES)  # fmt: skip
        return o

    return per_token, blocks


def attention_part() -> dict:
    """Part 1b: token blocks vs per-token decode, bitwise and timed."""
    import triton.testing

    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    for label, heads, kv_heads in (("0.6B", 16, 8), ("8B", 32, 8)):
        k_buf = torch.randn((64_000, kv_heads, 128), generator=g, device="cuda").bfloat16()
        v_buf = torch.randn((64_000, kv_heads, 128), generator=g, device="cuda").bfloat16()
        mixed = [(0, 2048), (300, 400), (1021, 477), (0, 5), (2999, 1), (4093, 7), (17, 130)]
        per_token, blocks = _extend_case(g, heads, k_buf, v_buf, mixed)
        a, b = per_token(), blocks()
        entry = {"tokens": a.shape[0], "tokens_differing": int((a != b).any(dim=1).sum()), "ms": {}}
        for case, requests in (("1 x 2048 prompt", [(0, 2048)]), ("16 x 128 after 1000", [(1000, 128)] * 16)):
            per_token, blocks = _extend_case(g, heads, k_buf, v_buf, requests)
            entry["ms"][case] = {
                "per token (decode kernel)": triton.testing.do_bench(per_token),
                "token blocks": triton.testing.do_bench(blocks),
            }
        out[label] = entry
        del k_buf, v_buf
    torch.cuda.empty_cache()
    return out


def workload(
    count: int, new_tokens: int, vocab: int | None = None, longest: int = 1024
) -> tuple[list[list[int]], list[dict]]:
    """Prompts of 64..longest ids (bench/gpu_serving.py's, or within [256, vocab - 256) when vocab is
    given), even requests greedy and odd ones sampled with a seed."""
    rng = random.Random(26)

    def ids(n: int) -> list[int]:
        return rand_ids(rng, n) if vocab is None else [rng.randrange(256, vocab - 256) for _ in range(n)]

    prompts = [ids(rng.randint(64, longest)) for _ in range(count)]
    params = []
    for i in range(count):
        sampling = {"temperature": 0.7, "top_p": 0.9, "seed": 1000 + i} if i % 2 else {"temperature": 0.0}
        params.append({**sampling, "ignore_eos": True, "max_new_tokens": new_tokens})
    return prompts, params


def outputs(path: Path, deterministic: bool, count: int, new_tokens: int) -> dict:
    """Outputs of the four runs, and how many of each equal the lone run's."""
    prompts, params = workload(count, new_tokens)
    kw = {"enable_deterministic_inference": deterministic, "attention_backend": "triton"}
    runs: dict[str, list[list[int]]] = {}
    t0 = time.perf_counter()
    with Engine(str(path), chunked_prefill_size=8192, **kw) as e:
        runs["alone"] = [
            e.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts, params)
        ]
        e.flush_cache()
        runs["batched"] = [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)]
        runs["batched, prompts cached"] = [
            r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)
        ]
    with Engine(str(path), chunked_prefill_size=128, **kw) as e:
        runs["batched, 128-token chunks"] = [
            r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)
        ]
    same = {
        name: sum(a == b for a, b in zip(got, runs["alone"])) for name, got in runs.items() if name != "alone"
    }
    say(f"deterministic={deterministic}: {same} of {count} ({time.perf_counter() - t0:.0f} s)")
    return {"identical_to_alone": same, "requests": count}


async def _burst(url: str, prompts: list[list[int]], params: list[dict]) -> list[list[int]]:
    """Every request at once, one native /generate call each (bench/http_burst.py); the output ids."""
    from bench.http_burst import HttpBurst

    burst = await HttpBurst.open(url, len(prompts), warm_path="/health")
    try:
        bodies = [{"input_ids": p, "sampling_params": s} for p, s in zip(prompts, params)]
        _, answers = await burst.post_json("/generate", bodies)
    finally:
        await burst.close()
    return [answer["output_ids"] for answer in answers]


def pipeline_outputs(deterministic: bool, count: int, new_tokens: int, tiny: bool) -> dict:
    """Part 4: the requests through `radixserve up` (twice: the second time their prompts are cached),
    and how many of each burst equal the same checkpoint's lone Engine run."""
    # Imported here: they need the pipeline's wheels (.whl-pipeline/), which parts 1-3 do without.
    from bench import gpu_pipeline, pipeline_overhead

    profile = gpu_pipeline.PROFILES["tiny" if tiny else "gpu"]
    device, backend = str(profile["device"]), str(profile["attention_backend"])
    gpu_pipeline.put_nats_server_on_path()
    path = gpu_pipeline.build_checkpoint(tiny, torch.bfloat16, device)
    longest = 128 if tiny else 1024
    prompts, params = workload(count, new_tokens, gpu_pipeline.SMOLLM2_VOCAB, longest)
    options: dict = {
        "device": device,
        "dtype": "bfloat16",
        "attention_backend": backend,
        "max_total_tokens": 2 * count * (longest + new_tokens),
        "enable_deterministic_inference": deterministic,
    }
    if device == "cpu":
        options["cpu_threads"] = 1  # both sides alike
    t0 = time.perf_counter()
    with Engine(str(path), **options) as e:
        alone = [e.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts, params)]
    with tempfile.TemporaryDirectory(prefix="rs-det-pipeline-") as run_dir:
        flags = pipeline_overhead.up_flags(path, options)
        stack = pipeline_overhead.Stack(int(profile["threads"]), flags, Path(run_dir))
        try:
            stack.wait_ready()
            runs = {"burst": asyncio.run(_burst(stack.url, prompts, params))}
            runs["burst, cached"] = asyncio.run(_burst(stack.url, prompts, params))
            switched = stack.worker_logged(r"deterministic inference: (\d+) modules use batch-invariant")
        finally:
            stack.stop()
    same = {name: sum(a == b for a, b in zip(got, alone)) for name, got in runs.items()}
    say(
        f"pipeline deterministic={deterministic}: {same} of {count}; the worker logged {switched} batch-invariant "
        f"modules ({time.perf_counter() - t0:.0f} s)"
    )
    # The worker's own word that the flag reached its model runner (None: it logged none).
    modules = int(switched) if switched is not None else None
    return {
        "identical_to_alone": same,
        "requests": count,
        "checkpoint": str(path),
        "worker_batch_invariant_modules": modules,
    }


class PrintedRows(list):
    """The result table, each row also printed as it lands."""

    def append(self, row: tuple[str, str]) -> None:
        super().append(row)
        print(f"  {row[0]:58s} {row[1]}", flush=True)


def kernels_part(tiles: str, results: dict, rows: list) -> bool:
    """Part 1: invariance and speed of the batch-invariant product; False if one of its rows varied."""
    results["kernels"] = kernel_check()
    ok = True
    for shape, r in results["kernels"].items():
        c = r["rows_differing_of_8"]
        ok &= c["batch_invariant"] == 0
        rows.append(
            (
                f"matmul {shape} rows differing alone vs batched (of 8)",
                f"batch-invariant {c['batch_invariant']}, cuBLAS {c['cublas']}; err {r['rel_err_vs_fp32']:.1e}",
            )
        )
    alternatives = []
    for t in [t for t in tiles.split(",") if t]:
        bm, bn, bk, warps, stages = (int(v) for v in t.split("/"))
        alternatives.append(MatmulTiles(bm, bn, bk, 8, warps, stages))
    results["kernel_speed"] = kernel_speed(alternatives)
    for shape, same in results["kernel_speed"]["block_m_equal"].items():
        rows.append((f"matmul {shape}: 128-row tiles == 64-row tiles", str(same)))
    ms = results["kernel_speed"]["ms"]
    for label, by_shape in ms.items():  # the full table, microseconds
        print(f"{label:36s} " + " ".join(f"{key}:{v * 1000:.1f}" for key, v in by_shape.items()))
    for label, by_shape in results["kernel_speed"].items():
        if label in ("ms", "block_m_equal"):
            continue
        worst = max(by_shape, key=by_shape.get)
        mean = sum(by_shape.values()) / len(by_shape)
        rows.append(
            (
                f"matmul tiles {label}: time / cuBLAS",
                f"mean {mean:.2f}, worst {by_shape[worst]:.2f} ({worst})",
            )
        )
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=None, help="default 64; --tiny: 8")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 48; --tiny: 8")
    ap.add_argument("--scale", type=float, default=1.0, help="P3's request count scale")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-outputs", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-pipeline", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="part 4 alone, on the CPU, with a 2-layer checkpoint")
    ap.add_argument(
        "--tiles",
        default="128/128/64/8/3,64/64/64/4/4,128/64/64/4/4",
        help="comma list of BM/BN/BK/warps/stages product tiles timed beside the default",
    )
    args = ap.parse_args()
    if args.tiny:  # parts 1-3 need CUDA
        args.skip_kernels = args.skip_attention = args.skip_outputs = args.skip_throughput = True
    args.requests = args.requests or (8 if args.tiny else 64)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 48)
    results: dict = {}
    rows = PrintedRows()
    ok = True
    OUT.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (OUT / "gpu_deterministic.json").write_text(json.dumps({"rows": rows, "results": results}, indent=2))

    if not args.skip_kernels:
        ok &= kernels_part(args.tiles, results, rows)
        save()
    if not args.skip_attention:
        results["attention"] = attention_part()
        for label, entry in results["attention"].items():
            ok &= entry["tokens_differing"] == 0
            rows.append((f"extend attention {label}: token blocks != per-token decode", f"{entry['tokens_differing']} of {entry['tokens']} tokens"))
            for case, ms in entry["ms"].items():
                old, new = ms["per token (decode kernel)"], ms["token blocks"]
                rows.append((f"extend attention {label} {case}", f"per token {old * 1000:.0f} us, blocks {new * 1000:.0f} us ({old / new:.1f}x)"))
        save()
    if not args.skip_outputs:
        path8 = build_checkpoint("8b", torch.bfloat16)
        for deterministic in (False, True):
            key = "deterministic" if deterministic else "default"
            results[key] = outputs(path8, deterministic, args.requests, args.new_tokens)
            for name, n in results[key]["identical_to_alone"].items():
                rows.append((f"8B {key}: {name} == alone", f"{n} / {args.requests}"))
                if deterministic:
                    ok &= n == args.requests
            save()
    if not args.skip_throughput:
        path06 = build_checkpoint("0.6b", torch.bfloat16)
        bw, flops = copy_bandwidth(), matmul_rate()
        p3_default = p3(path06, bw, flops, args.scale, {})
        rows.append(
            ("P3 0.6B default", f"{p3_default['tok_s']:.0f} tok/s (ceiling ratio {p3_default['ratio']:.2f})")
        )
        p3_det = p3(path06, bw, flops, args.scale, {"enable_deterministic_inference": True})
        kept = p3_det["tok_s"] / p3_default["tok_s"]
        results["p3"] = {"default": p3_default, "deterministic": p3_det, "throughput_kept": kept}
        rows.append(("P3 0.6B deterministic", f"{p3_det['tok_s']:.0f} tok/s; kept {kept:.2f} (goal >= 0.80)"))
        save()
    if not args.skip_pipeline:
        label = "tiny" if args.tiny else "0.6B"
        results["pipeline"] = {}
        for deterministic in (False, True):
            key = "deterministic" if deterministic else "default"
            got = pipeline_outputs(deterministic, args.requests, args.new_tokens, args.tiny)
            results["pipeline"][key] = got
            for name, n in got["identical_to_alone"].items():
                rows.append((f"pipeline {label} {key}: {name} == alone", f"{n} / {args.requests}"))
                if deterministic:
                    ok &= n == args.requests
            save()
    print("\n== gpu_deterministic ==")
    for k, v in rows:
        print(f"{k:58s} {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
