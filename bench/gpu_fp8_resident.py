"""FP8-resident weights on one GPU through the Engine: an FP8 checkpoint and `--quantization fp8` against
the same weights dequantized to bf16, and what the FP8 weights free for the KV pool.

    python bench/gpu_fp8_resident.py [0.6b|8b] [--init R] [--logprobs-only]   (repository root, on a GPU)

--init R builds the dense checkpoint at initializer_range R (default 0.02) under its own /tmp name;
--logprobs-only runs the dense shape's FP8 checkpoint, its dequantized copy and the FP8-KV control alone
(no MoE, no `--quantization fp8` pair, no decode timing, no byte checks), then the dequantized copy in
transformers' Qwen3 with and without the w8a8 scheme's activation rounding (the scheme's own distance on
these weights, in plain torch arithmetic, and our bf16 Engine's distance from transformers'), and requires
the log-prob check.

Builds (once per machine, under /tmp) a random Qwen3 checkpoint of the named shape in bf16
(initializer_range 0.02, so activations stay in a trained model's range), its FP8 copy in the published
layout (every `*_proj.weight` of the decoder layers block-quantized 128x128 by layers/fp8.quantize_blocks,
`weight_scale_inv` beside it, transformers' FineGrainedFP8 quantization_config) and the plain bf16 copy
of that FP8 copy's dequantized weights (the reference), and a small Qwen3-MoE likewise. Then, greedy,
8 prompts of mixed lengths, 32 new tokens each, prompt log-probs scored:
- fp8 checkpoint (resident by default on CUDA; CUDA graphs on) vs its dequantized bf16 copy: greedy
  agreement and prompt log-prob differences (required: mean |dlogprob| <= MEAN_LOGPROB_TOL);
- the same with CUDA graphs off vs on: reported (a padded graph batch may pick other GEMM tiles);
- `--quantization fp8` on the bf16 checkpoint vs the unquantized bf16 model: reported only;
- weight bytes the worker reports and its KV pool (sized from the memory left after loading): FP8 saves at
  least 0.49 of the projections' bf16 bytes (the embedding, LM head and norms stay bf16) and leaves a
  larger pool (required);
- a control of the model's sensitivity: the dequantized bf16 copy with an FP8 (e4m3) KV cache, i.e. the same
  e4m3 rounding applied to K and V only, against the same copy with a bf16 cache. Random checkpoints deep
  enough are chaotic: on the Qwen3-8B shape that rounding alone moved the prompt log-probs by 0.23 (mean)
  and changed the first greedy token of most prompts (2026-12-03), so the log-prob check is
  mean |dlogprob| <= max(MEAN_LOGPROB_TOL, 2 x the control's);
- batch-1 decode tok/s, FP8 resident vs bf16, each beside its ceiling (checkpoint bytes / copy bandwidth).
Prints a table last; with $OUT set the JSON goes to $OUT/gpu_fp8_resident.json. Exit 1 when a required
check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cpu_fp8_sensitivity import PROMPT_LENS, bench_prompts, rounded_inputs, score  # noqa: E402
from bench.gpu_common import (  # noqa: E402
    OUT,
    batch1_decode_tok_s,
    build_checkpoint,
    build_moe_checkpoint,
    copy_bandwidth,
    weight_bytes,
)
from services.worker.frontend.engine import Engine  # noqa: E402
from services.worker.runtime.layers.fp8 import dequantize_blocks, quantize_blocks  # noqa: E402

BLOCK = (128, 128)
NEW_TOKENS = 32
# The FP8 GEMM also rounds the activations to e4m3 (per token group), so the prompt log-probs move a
# little against the dequantized weights in bf16; a wiring error (a wrong scale, a transposed block)
# moves them by whole nats.
MEAN_LOGPROB_TOL = 0.05
DECODE_STEPS = 256


def projection_bytes(path: Path) -> int:
    """Bytes of the decoder layers' `*_proj.weight` tensors in a checkpoint (the weights FP8 halves; the
    embedding, LM head, norms and router stay in bf16), read from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                    s = f.get_slice(name)
                    total += math.prod(s.get_shape()) * 2  # bf16
    return total


def write_fp8_copies(src: Path) -> tuple[Path, Path]:
    """(FP8 copy of src, bf16 copy of src holding the FP8 copy's dequantized weights), built once."""
    from safetensors.torch import load_file, save_file

    fp8_dir, deq_dir = Path(f"{src}-fp8"), Path(f"{src}-fp8-dequantized")
    if (fp8_dir / "config.json").exists() and (deq_dir / "config.json").exists():
        return fp8_dir, deq_dir
    for out in (fp8_dir, deq_dir):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
        for f in out.glob("*.safetensors*"):
            f.unlink()
    fp8_tensors, deq_tensors = {}, {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(file), device="cuda").items():
            # The decoder layers' linear and expert weights; not the router (mlp.gate), norms or heads.
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                q, scale = quantize_blocks(tensor, BLOCK)
                fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q.cpu(), scale.cpu()
                deq_tensors[name] = dequantize_blocks(q, scale, BLOCK).to(tensor.dtype).cpu()
            else:
                fp8_tensors[name] = deq_tensors[name] = tensor.cpu()
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq_tensors, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
    }  # fmt: skip
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir


def run(path: Path, decode: bool = True, **kw: object) -> dict:
    """Greedy tokens, prompt log-probs, the worker's weight bytes and KV pool, batch-1 decode tok/s (0.0 when
    not `decode`)."""
    prompts = bench_prompts()
    t0 = time.perf_counter()
    with Engine(str(path), mem_fraction_static=0.5, **kw) as e:
        info = e.get_server_info()
        greedy = e.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        scored = e.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
            logprob_start_len=0,
        )  # fmt: skip
        decode = batch1_decode_tok_s(e, DECODE_STEPS) if decode else 0.0
    print(f"  {path.name} {kw}: {time.perf_counter() - t0:.1f} s", flush=True)
    return {
        "tokens": [r["output_ids"] for r in greedy],
        "logprobs": [[lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in scored],
        "weight_bytes": info["weight_bytes"],
        "kv_tokens": info["max_total_tokens"],
        "decode_tok_s": decode,
    }


def logprob_diffs(xss: list[list[float]], yss: list[list[float]]) -> list[float]:
    """|a - b| for every scored token of every prompt."""
    return [abs(a - b) for xs, ys in zip(xss, yss) for a, b in zip(xs, ys)]


def compare(ours: dict, ref: dict) -> dict:
    diffs = logprob_diffs(ours["logprobs"], ref["logprobs"])
    firsts = [
        next((i for i, (a, b) in enumerate(zip(xs, ys)) if a != b), len(xs)) for xs, ys in zip(ours["tokens"], ref["tokens"])
    ]  # fmt: skip
    return {
        "tokens_identical": ours["tokens"] == ref["tokens"],
        "greedy_tokens_before_divergence": firsts,
        "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        "max_abs_logprob_diff": max(diffs),
    }


def mean_abs_diff(xss: list[list[float]], yss: list[list[float]]) -> float:
    diffs = logprob_diffs(xss, yss)
    return sum(diffs) / len(diffs)


def scheme_distance(deq_dir: Path, deq: dict) -> dict:
    """The same weights in transformers' Qwen3 on this GPU (bf16): how far the w8a8 scheme's own rounding
    moves the prompt log-probs in plain torch arithmetic (every decoder `*_proj` input rounded per token group
    of 128 to e4m3, bench/cpu_fp8_sensitivity.py), and how far our bf16 Engine is from transformers' bf16."""
    from transformers import AutoModelForCausalLM

    prompts = bench_prompts()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(deq_dir), dtype=torch.bfloat16).to(device).eval()
    plain, _ = score(model, prompts)
    handles = rounded_inputs(model)
    rounded, _ = score(model, prompts)
    for h in handles:
        h.remove()
    del model
    torch.cuda.empty_cache()
    return {
        "w8a8_scheme_mean_abs_logprob_diff": mean_abs_diff(rounded, plain),
        "engine_bf16_vs_transformers_bf16_mean_abs_logprob_diff": mean_abs_diff(deq["logprobs"], plain),
    }


def logprobs_only(label: str, src: Path) -> int:
    """--logprobs-only: the FP8 checkpoint vs its dequantized copy, beside the FP8-KV control and the w8a8
    scheme's own distance on the same weights (transformers)."""
    fp8_dir, deq_dir = write_fp8_copies(src)
    fp8, deq = run(fp8_dir, decode=False), run(deq_dir, decode=False)
    control = run(deq_dir, decode=False, kv_cache_dtype="fp8_e4m3")
    c, k = compare(fp8, deq), compare(control, deq)
    scheme = scheme_distance(deq_dir, deq)
    ok = c["mean_abs_logprob_diff"] <= max(MEAN_LOGPROB_TOL, 2 * k["mean_abs_logprob_diff"])
    result = {
        "ok": ok,
        "results": {label: {"fp8_vs_dequantized_bf16": c, "control_fp8_kv_vs_bf16_kv": k, "scheme": scheme}},
    }
    if os.environ.get("OUT"):
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_fp8_resident.json").write_text(json.dumps(result, indent=2))
    greedy = sum(f == NEW_TOKENS for f in c["greedy_tokens_before_divergence"])
    print(
        f"{'model':24s} {'mean|dlp|':>9s} {'max|dlp|':>8s} {'ctl mean':>8s} {'scheme':>8s} {'vs HF':>8s} greedy= check"
    )
    print(f"{label:24s} {c['mean_abs_logprob_diff']:9.4f} {c['max_abs_logprob_diff']:8.3f} "
          f"{k['mean_abs_logprob_diff']:8.4f} {scheme['w8a8_scheme_mean_abs_logprob_diff']:8.4f} "
          f"{scheme['engine_bf16_vs_transformers_bf16_mean_abs_logprob_diff']:8.4f} "
          f"{greedy}/{len(PROMPT_LENS)}    {'ok' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", nargs="?", default="0.6b", choices=("0.6b", "8b"))
    parser.add_argument("--init", type=float, default=0.02, help="the dense checkpoint's initializer_range")
    parser.add_argument("--logprobs-only", action="store_true")
    args = parser.parse_args()
    shape = args.shape
    dense = build_checkpoint(shape, torch.bfloat16, initializer_range=args.init)
    init = "" if args.init == 0.02 else f"-init{args.init}"
    if args.logprobs_only:
        return logprobs_only(f"qwen3-{shape}{init}", dense)
    moe = build_moe_checkpoint(
        "fp8-bench", torch.bfloat16, 0.02, vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        head_dim=128, num_experts=32, num_experts_per_tok=4, max_position_embeddings=4096,
    )  # fmt: skip
    results: dict[str, dict] = {}
    ok = True
    rows = []
    bandwidth = copy_bandwidth()
    for label, src in ((f"qwen3-{shape}{init}", dense), ("qwen3-moe-small", moe)):
        fp8_dir, deq_dir = write_fp8_copies(src)
        fp8 = run(fp8_dir)
        fp8_eager = run(fp8_dir, cuda_graph_max_bs=0, cuda_graph_max_extend_tokens=0)
        deq = run(deq_dir)
        control = run(deq_dir, kv_cache_dtype="fp8_e4m3")
        quant = run(src, quantization="fp8")
        plain = run(src)
        r = {
            "fp8_vs_dequantized_bf16": compare(fp8, deq),
            "fp8_graphs_vs_eager": compare(fp8, fp8_eager),
            "control_fp8_kv_vs_bf16_kv": compare(control, deq),
            "quantization_fp8_vs_bf16": compare(quant, plain),
            "weight_bytes": {"fp8": fp8["weight_bytes"], "bf16": deq["weight_bytes"], "quantized": quant["weight_bytes"]},
            "kv_tokens": {"fp8": fp8["kv_tokens"], "bf16": deq["kv_tokens"], "quantized": quant["kv_tokens"]},
            "decode_tok_s": {"fp8": fp8["decode_tok_s"], "bf16": deq["decode_tok_s"], "quantized": quant["decode_tok_s"]},
            # the ceiling: every checkpoint byte read once per step over the measured copy bandwidth (as gpu_engine.py)
            "decode_ceiling_tok_s": {"fp8": bandwidth / weight_bytes(fp8_dir), "bf16": bandwidth / weight_bytes(deq_dir)},
            "copy_bandwidth": bandwidth,
        }  # fmt: skip
        r["decode_of_ceiling"] = {
            k: r["decode_tok_s"][k] / r["decode_ceiling_tok_s"][k] for k in ("fp8", "bf16")
        }
        proj = projection_bytes(deq_dir)
        checks = {
            "logprobs_within_tol": r["fp8_vs_dequantized_bf16"]["mean_abs_logprob_diff"]
            <= max(MEAN_LOGPROB_TOL, 2 * r["control_fp8_kv_vs_bf16_kv"]["mean_abs_logprob_diff"]),
            # FP8 halves the projections (their block scales add 1/16,384 of them); the rest stays bf16.
            "fp8_bytes_save_0.49_of_projections": fp8["weight_bytes"] <= deq["weight_bytes"] - 0.49 * proj,
            "quantized_bytes_save_0.49_of_projections": quant["weight_bytes"]
            <= plain["weight_bytes"] - 0.49 * proj,
            "fp8_kv_pool_larger": fp8["kv_tokens"] > deq["kv_tokens"],
        }
        r["required"] = checks
        ok &= all(checks.values())
        results[label] = r
        c, q = r["fp8_vs_dequantized_bf16"], r["quantization_fp8_vs_bf16"]
        rows.append(
            f"{label:18s} {c['mean_abs_logprob_diff']:8.4f} {c['max_abs_logprob_diff']:8.3f} "
            f"{r['control_fp8_kv_vs_bf16_kv']['mean_abs_logprob_diff']:8.4f} "
            f"{sum(f == NEW_TOKENS for f in c['greedy_tokens_before_divergence'])}/{len(PROMPT_LENS)}      "
            f"{q['mean_abs_logprob_diff']:8.4f} {'=' if r['fp8_graphs_vs_eager']['tokens_identical'] else '!=':>6s} "
            f"{fp8['weight_bytes'] / deq['weight_bytes']:6.3f} "
            f"{fp8['kv_tokens'] / deq['kv_tokens']:6.2f} {fp8['decode_tok_s']:8.1f} "
            f"({r['decode_of_ceiling']['fp8']:.3f}) {deq['decode_tok_s']:8.1f} ({r['decode_of_ceiling']['bf16']:.3f}) "
            f"{'ok' if all(checks.values()) else 'FAIL ' + ','.join(k for k, v in checks.items() if not v)}"
        )
        print(rows[-1], flush=True)
        if os.environ.get("OUT"):  # after each model: a run cut off by its time limit keeps what it measured
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / "gpu_fp8_resident.json").write_text(json.dumps({"ok": ok, "results": results}, indent=2))
    print(json.dumps({"ok": ok, "required": {k: v["required"] for k, v in results.items()}}))
    print(f"{'model':18s} {'mean|dlp|':>8s} {'max|dlp|':>8s} {'ctl mean':>8s} greedy=  {'q8 mean':>8s} {'graphs':>6s} {'bytes':>6s} {'kv':>6s} "
          f"{'fp8 tok/s (of ceiling)':>8s} {'bf16 tok/s (of ceiling)':>8s} checks")  # fmt: skip
    for row in rows:
        print(row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
