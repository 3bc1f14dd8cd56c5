"""The engine on one GPU: correctness against transformers and between backends, then batch-1 decode
speed beside its ceiling, for random-init Qwen3-shaped models (no weights can be downloaded there).

    python bench/gpu_engine.py [--models 0.6b,8b] [--steps 256]

Checks (float32 where token identity is asserted, so rounding cannot flip a near-tie):
  1. engine greedy tokens == transformers greedy tokens (Qwen3-0.6B-shaped, fp32, 32 steps);
  2. triton backend == torch backend, 64 greedy steps, mixed lengths with shared prefixes (fp32);
  3. chunked prefill == unchunked (triton, fp32);
  4. bf16 log-probs of the chosen tokens close to transformers' bf16 ones.
Figures: decode tok/s at batch 1 (128-token prompt, --steps new tokens, bf16) against the ceiling
(weight bytes read per step / measured device copy bandwidth), and transformers' eager generate as peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoModelForCausalLM  # noqa: E402

import kernels.decode_attention as decode  # noqa: E402
from bench.gpu_common import OUT, batch1_decode_tok_s, build_checkpoint, copy_bandwidth, weight_bytes  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402
from shared.progress import progress_bar  # noqa: E402


def hf_greedy(path: Path, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(o[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


POOL = 65536


def engine_greedy(path: Path, prompts: list[list[int]], n: int, **kw: object) -> list[list[int]]:
    with Engine(str(path), max_total_tokens=POOL, **kw) as e:
        res = e.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                             "ignore_eos": True})
    return [r["output_ids"] for r in res]


def decode_speed(path: Path, steps: int, **kw: object) -> float:
    with Engine(str(path), max_total_tokens=POOL, **kw) as e:
        return batch1_decode_tok_s(e, steps)


def hf_speed(path: Path, steps: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    ids = torch.arange(1000, 1128, device="cuda")[None]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None)
        torch.cuda.synchronize()
    del model
    torch.cuda.empty_cache()
    return steps / (time.perf_counter() - t0)


def hf_compile_speed(path: Path, steps: int) -> tuple[float, float]:
    """transformers' generate with a static cache and torch.compile (mode "default": "reduce-overhead"
    fails with transformers 5.17 / torch 2.11 on overwritten CUDA-graph outputs). Returns (tok/s,
    seconds the first call took, compilation included)."""
    from transformers import CompileConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    ids = torch.arange(1000, 1128, device="cuda")[None]
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
              cache_implementation="static", compile_config=CompileConfig(mode="default"))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, **kw)  # compiles (the static cache has this call's length, so no recompiles)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        tps = steps / (time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return tps, first


def decode_variant(path: Path, steps: int, target: Any, defaults: tuple, **kw: object) -> float:
    """decode_speed with `target`'s default arguments replaced (a kernel launch parameter; None: no
    patch) and/or other engine options."""
    saved = target.__defaults__ if target is not None else None
    if target is not None:
        target.__defaults__ = defaults
    try:
        return decode_speed(path, steps, attention_backend="triton", **kw)
    finally:
        if target is not None:
            target.__defaults__ = saved


class PrintedRows(list):
    """The result table, each row also printed as it lands: a call cut off by its time limit still
    shows what it measured."""

    def append(self, row: tuple[str, str]) -> None:
        super().append(row)
        print(f"  {row[0]:55s} {row[1]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
    ap.add_argument("--also-thread", action="store_true",
                    help="rerun decode with the scheduler in a thread of this process (default on CUDA: its own)")
    ap.add_argument("--decode-tiles", default="",
                    help="comma list of BLOCK_N/WARPS/STAGES (e.g. 64/4/3): rerun decode with those tiles")
    ap.add_argument("--tokens-per-split", default="",
                    help="comma list: rerun decode with the split-K kernel's min tokens per split set to each")
    args = ap.parse_args()
    rows = PrintedRows()
    results: dict[str, object] = {}
    ok = True
    if not args.skip_checks:
        path32 = build_checkpoint("0.6b", torch.float32)
        g = torch.Generator().manual_seed(3)
        shared = torch.randint(10, 150000, (48,), generator=g).tolist()
        prompts = [torch.randint(10, 150000, (int(n),), generator=g).tolist() for n in (5, 40, 17, 90)]
        prompts += [shared + torch.randint(10, 150000, (int(n),), generator=g).tolist() for n in (3, 30, 11)]
        ours = engine_greedy(path32, prompts[:3], 32, attention_backend="triton", dtype="float32")
        ref = hf_greedy(path32, prompts[:3], 32, torch.float32)
        same = ours == ref
        rows.append(("engine (triton, fp32) == transformers greedy, 32 steps", str(same)))
        ok &= same
        tri = engine_greedy(path32, prompts, 64, attention_backend="triton", dtype="float32")
        tor = engine_greedy(path32, prompts, 64, attention_backend="torch", dtype="float32")
        rows.append(("triton == torch backend, 64 steps, 7 mixed reqs", str(tri == tor)))
        ok &= tri == tor
        chunked = engine_greedy(path32, prompts, 16, attention_backend="triton", dtype="float32",
                                chunked_prefill_size=16)
        same_chunk = chunked == [t[:16] for t in tri]
        rows.append(("chunked(16) == unchunked (triton)", str(same_chunk)))
        ok &= same_chunk
        # Chunks after a long prefix: the extend kernel splits the prefix over programs.
        long_prompt = [torch.randint(10, 150000, (3000,), generator=g).tolist()]
        whole = engine_greedy(path32, long_prompt, 16, attention_backend="triton", dtype="float32",
                              chunked_prefill_size=None)
        pieces = engine_greedy(path32, long_prompt, 16, attention_backend="triton", dtype="float32",
                               chunked_prefill_size=256)
        rows.append(("chunked(256) == unchunked, 3000-token prompt (split prefixes)", str(whole == pieces)))
        ok &= whole == pieces
    bw = copy_bandwidth()
    rows.append(("device copy bandwidth (read+write)", f"{bw / 1e9:.0f} GB/s"))
    models = [m for m in args.models.split(",") if m]
    for name in progress_bar(models, desc="models", lines_when_piped=False):
        path = build_checkpoint(name, torch.bfloat16)
        ceiling = bw / weight_bytes(path)
        tps = decode_speed(path, args.steps, attention_backend="triton")
        hf = float("nan") if args.skip_hf else hf_speed(path, min(args.steps, 64))
        results[name] = {"tok_s": tps, "ceiling_tok_s": ceiling, "ratio": tps / ceiling, "hf_eager_tok_s": hf}
        rows.append((f"Qwen3-{name} bs1 decode (bf16, triton)",
                     f"{tps:.1f} tok/s; ceiling {ceiling:.0f}; ratio {tps / ceiling:.3f}; HF eager {hf:.1f}"))
        if args.hf_compile:
            ctps, first = hf_compile_speed(path, min(args.steps, 64))
            results[name].update(hf_compile_tok_s=ctps, hf_compile_ratio=ctps / ceiling, hf_compile_first_call_s=first)
            rows.append((f"Qwen3-{name} HF static cache + torch.compile",
                         f"{ctps:.1f} tok/s; ratio {ctps / ceiling:.3f}; first call {first:.0f} s"))
        variants: list[tuple[str, str, Any, tuple, dict]] = [
            (f"split{n}", f"{n} tokens/split", decode.kv_splits_per_request, (None, n), {})
            for n in [int(x) for x in args.tokens_per_split.split(",") if x]
        ]
        if args.also_thread:
            variants.append(("thread", "scheduler thread", None, (), {"scheduler_process": False}))
        variants += [
            (f"tiles{t}", f"decode tiles {t}", decode.DecodeTiles.__init__, tuple(int(v) for v in t.split("/")), {})
            for t in [x for x in args.decode_tiles.split(",") if x]
        ]
        for key, label, target, defaults, kw in progress_bar(variants, desc=f"{name} variants", lines_when_piped=False,
                                                             leave=False):
            tps = decode_variant(path, args.steps, target, defaults, **kw)
            results[f"{name}-{key}"] = {"tok_s": tps, "ratio": tps / ceiling}
            rows.append((f"Qwen3-{name} bs1 decode, {label}", f"{tps:.1f} tok/s; ratio {tps / ceiling:.3f}"))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_engine.json").write_text(json.dumps({"rows": rows, "results": results}, indent=2))
    print("\n== gpu_engine ==")
    for k, v in rows:
        print(f"{k:55s} {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
