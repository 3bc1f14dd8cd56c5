"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention) through the offline Engine on one GPU, at
published sizes with seeded random bf16 weights (nothing can be downloaded on the device machine).

    python bench/gpu_qwen35.py [--models 9b,35b-a3b] [--figures decode,peer,offline,prefix] [--steps 256]
                               [--scale 1.0] [--moe-layers 40]
    python bench/gpu_qwen35.py --tiny      # every step at toy sizes, on CPU when there is no GPU
    python bench/gpu_qwen35.py --fp8 --models 35b-a3b --figures decode   # the full 40 layers in FP8

Shapes (the published configs; transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults mirror
them except rope_theta, which the published models set to 1e7):
  9b        Qwen/Qwen3.5-9B text model: hidden 4096, 32 layers (3 Gated DeltaNet : 1 gated attention),
            FFN 12288, attention 16 Q / 4 KV heads of 256 (rotary 64), DeltaNet 16 QK / 32 V heads of
            128, vocab 248320, untied.
  35b-a3b   Qwen/Qwen3.5-35B-A3B text model: hidden 2048, 40 layers (3:1), 256 experts top-8 of 512
            plus a shared expert of 512, attention 16 Q / 2 KV heads of 256, DeltaNet 16 QK / 32 V
            heads of 128, vocab 248320, untied. About 70 GB in bf16: it needs that much disk under
            /tmp and GPU memory (the one-GPU machine's 64 GiB disk is too small: run it on a bigger
            kind, or --moe-layers N keeps the first N layers, recorded in the JSON). With --fp8 it is
            ~35 GB and runs whole on one H200.
--fp8: the checkpoint is written straight in the published FP8 layout (bench/qwen35_fp8_build.py: layer
by layer, never the whole bf16 model on disk or GPU; 128x128 blocks, 16x16 under --tiny) and the engine
keeps the weights FP8-resident; the ceiling counts the bytes as stored (FP8 projections and their
float32 scales, of the routed experts only top-k; bf16 embedding, LM head, router, norms, DeltaNet b/a).
The peer figure is skipped (transformers' FP8 path is not what is measured here).
Figures, each beside what it is measured against in the same run:
  decode    batch-1 decode tok/s (128-token prompt, --steps new tokens) vs the ceiling: weight bytes
            one step reads (every weight once; for the MoE only top-k of the routed experts) divided
            by the measured device copy bandwidth. Goal: ratio >= 0.8.
  peer      transformers' generate (eager, bf16) on the same weights, batch 1; and whether its
            greedy tokens equal the engine's (informational: bf16 rounding can flip near ties).
  offline   nano-vllm's recipe: 256 requests, input and output lengths uniform in [100, 1024],
            temperature 0.6, ignore_eos; output tok/s.
  prefix    64 groups x 16 prompts (2048-token shared system prompt + 128-token question), 256 output
            tokens: the hybrid prefix cache (state snapshots) on vs --disable-radix-cache, hit rate
            and the speed-up (goal >= 2x).
One JSON line on stdout (and $OUT/gpu_qwen35.json when $OUT is set), then a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors import safe_open  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from bench.gpu_common import copy_bandwidth  # noqa: E402
from bench.qwen35_fp8_build import write_fp8_checkpoint  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
              linear_num_value_heads=32, full_attention_interval=4)
SHAPES: dict[str, tuple[type, dict[str, Any], str]] = {
    "9b": (Qwen3_5TextConfig, dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=256, **LINEAR),
           "Qwen/Qwen3.5-9B (text model)"),
    "35b-a3b": (Qwen3_5MoeTextConfig, dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                           num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
                                           moe_intermediate_size=512, shared_expert_intermediate_size=512, **LINEAR),
                "Qwen/Qwen3.5-35B-A3B (text model)"),
    # --tiny: the same layer kinds and head ratios at toy widths.
    "tiny": (Qwen3_5TextConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     **{**LINEAR, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                        "linear_num_key_heads": 2, "linear_num_value_heads": 4}), "toy"),
    "tiny-moe": (Qwen3_5MoeTextConfig, dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                            **{**LINEAR, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                               "linear_num_key_heads": 2, "linear_num_value_heads": 4}), "toy"),
}
VOCAB = {"tiny": 512, "tiny-moe": 512}


def make_config(name: str, layers: int | None, vocab: int) -> tuple[Any, type, str]:
    """(transformers config, model class, source) of the named shape, cut to `layers` when given."""
    config_class, shape, source = SHAPES[name]
    shape = dict(shape)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = config_class(vocab_size=vocab, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters=ROPE,
                          initializer_range=0.02, tie_word_embeddings=False, eos_token_id=0, **shape)
    model_class = Qwen3_5ForCausalLM if config_class is Qwen3_5TextConfig else Qwen3_5MoeForCausalLM
    return config, model_class, source


def build(name: str, device: str, layers: int | None, vocab: int, fp8: bool = False) -> tuple[Path, dict[str, Any]]:
    """A seeded random checkpoint of the named shape under /tmp (built once per machine): bf16, built
    in bf16 from the start (a 35B model in float32 would not fit the GPU), or with fp8 the published
    FP8 layout written layer by layer (bench/qwen35_fp8_build.py)."""
    config, model_class, source = make_config(name, layers, vocab)
    meta = {"source": source, "layers": config.num_hidden_layers, "vocab_size": vocab,
            "layer_types": list(config.layer_types)}
    if fp8:
        block = (16, 16) if name.startswith("tiny") else (128, 128)
        path = Path(f"/tmp/rs-qwen35-{name}-l{config.num_hidden_layers}-fp8")
        write_fp8_checkpoint(path, model_class, config, block, device)
        return path, {**meta, "weights": "fp8", "weight_block_size": list(block)}
    path = Path(f"/tmp/rs-qwen35-{name}-l{config.num_hidden_layers}-bf16")
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = model_class(config)
        finally:
            torch.set_default_dtype(default)
        model.save_pretrained(str(path))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return path, {**meta, "weights": "bf16"}


def published_parameters(name: str) -> float:
    """Parameters (billions) of the named published shape, counted on the meta device (no memory)."""
    config_class, shape, _ = SHAPES[name]
    config = config_class(vocab_size=248320, rope_parameters=ROPE, tie_word_embeddings=False, **shape)
    model_class = Qwen3_5ForCausalLM if config_class is Qwen3_5TextConfig else Qwen3_5MoeForCausalLM
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters()) / 1e9


# Bytes per element of the safetensors dtypes these checkpoints hold.
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def step_bytes(path: Path) -> tuple[int, int]:
    """(bytes in the checkpoint, bytes one batch-1 decode step reads: every tensor as stored (an FP8
    checkpoint's FP8 weights at one byte, their float32 scales at four), of the routed experts only
    top-k of num_experts)."""
    config = json.loads((path / "config.json").read_text())
    share = config["num_experts_per_tok"] / config["num_experts"] if "num_experts" in config else 1.0
    total = routed = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = torch.Size(t.get_shape()).numel() * DTYPE_BYTES[t.get_dtype()]
                total += n
                if ".mlp.experts." in key:
                    routed += n
    return total, int(total - routed * (1 - share))


def cpu_copy_bandwidth() -> float:
    """Host copy of 256 MiB, bytes read + written per second (median of 5): --tiny's stand-in."""
    a = torch.empty(1 << 28, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() / sorted(times)[2]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_speed(path: Path, steps: int, vocab: int, engine_kw: dict) -> tuple[float, list[int]]:
    """Batch-1 decode tok/s: (steps - 1) / (time of a steps-token request - time of a 1-token request),
    both medians of 3 on prompts that share the cached 126-token prefix (so both take the same prefill
    path, warmed up first: the first prefix hit compiles kernels), and the greedy tokens of a timed run."""
    prompt = [(1000 + i) % vocab for i in range(128)]
    greedy = {"temperature": 0, "ignore_eos": True}

    def run(e: Engine, k: int, n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = e.generate(input_ids=prompt[:-2] + [9, 10 + k], sampling_params={**greedy, "max_new_tokens": n})
        return time.perf_counter() - t0, out["output_ids"]

    with Engine(str(path), **engine_kw) as e:
        e.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 8})
        run(e, 0, 8)
        one = sorted(run(e, 1 + k, 1)[0] for k in range(3))[1]
        timed = [run(e, 10 + k, steps) for k in range(3)]
    total = sorted(t for t, _ in timed)[1]
    return (steps - 1) / max(total - one, 1e-9), timed[0][1]


def hf_peer(path: Path, steps: int, vocab: int, device: str) -> tuple[float, list[int]]:
    """transformers' eager generate, bf16, batch 1, on the same prompt: tok/s and its greedy tokens."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([[(1000 + i) % vocab for i in range(126)] + [9, 20]], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kw)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
        sync()
        dt = time.perf_counter() - t0
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return steps / dt, out[0, ids.shape[1]:].tolist()


def offline(path: Path, scale: float, vocab: int, lengths: tuple[int, int], engine_kw: dict) -> dict:
    """nano-vllm's recipe (256 requests, lengths uniform in [100, 1024] at full size)."""
    rng = random.Random(0)
    n = max(4, int(256 * scale))
    ins = [rng.randint(*lengths) for _ in range(n)]
    outs = [rng.randint(*lengths) for _ in range(n)]
    prompts = [[rng.randrange(10, vocab) for _ in range(i)] for i in ins]
    params = [{"temperature": 0.6, "ignore_eos": True, "max_new_tokens": o, "seed": k} for k, o in enumerate(outs)]
    with Engine(str(path), **engine_kw) as e:
        e.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4})
        t0 = time.perf_counter()
        results = e.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
    assert [len(r["output_ids"]) for r in results] == outs
    return {"requests": n, "output_tokens": sum(outs), "seconds": dt, "tok_s": sum(outs) / dt}


def shared_prefix(path: Path, scale: float, vocab: int, sizes: tuple[int, int, int], engine_kw: dict) -> dict:
    """Groups of 16 prompts sharing a system prompt: cache on (snapshots) vs off; same greedy tokens."""
    system_len, question_len, new = sizes
    rng = random.Random(1)
    groups, per_group = max(2, int(64 * scale)), 16
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(10, vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(10, vocab) for _ in range(question_len)] for _ in range(per_group)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new}
    total_prompt = sum(len(p) for p in prompts)
    res: dict[str, Any] = {"groups": groups, "per_group": per_group}
    tokens = {}
    for label, disable in (("cache_on", False), ("cache_off", True)):
        with Engine(str(path), disable_radix_cache=disable, schedule_policy="lpm", **engine_kw) as e:
            t0 = time.perf_counter()
            out = e.generate(input_ids=prompts, sampling_params=params)
            dt = time.perf_counter() - t0
        tokens[label] = [o["output_ids"] for o in out]
        cached = sum(o["meta_info"]["cached_tokens"] for o in out)
        res[label] = {"seconds": dt, "tok_s": len(prompts) * new / dt, "hit_rate": cached / total_prompt}
    res["ideal_hit_rate"] = groups * (per_group - 1) * system_len / total_prompt
    res["speedup"] = res["cache_off"]["seconds"] / res["cache_on"]["seconds"]
    res["same_tokens_share"] = sum(a == b for a, b in zip(tokens["cache_on"], tokens["cache_off"])) / len(prompts)
    return res


def run_model(name: str, args: argparse.Namespace, bw: float, device: str, engine_kw: dict) -> dict:
    vocab = VOCAB.get(name, 248320)
    layers = args.moe_layers if name == "35b-a3b" else None
    path, meta = build(name, device, layers, vocab, fp8=args.fp8)
    total, per_step = step_bytes(path)
    ceiling = bw / per_step
    res: dict[str, Any] = {**meta, "weight_bytes": total, "step_bytes": per_step, "ceiling_tok_s": ceiling}
    figures = set(args.figures.split(","))
    ours: list[int] = []
    if "decode" in figures:
        tps, ours = decode_speed(path, args.steps, vocab, engine_kw)
        res.update(decode_tok_s=tps, decode_ratio=tps / ceiling)
    if "peer" in figures and not args.fp8:
        hf_steps = min(args.steps, args.hf_steps)
        hf_tps, theirs = hf_peer(path, hf_steps, vocab, device)
        res.update(hf_eager_tok_s=hf_tps, hf_steps=hf_steps)
        if ours:
            res.update(vs_hf=res["decode_tok_s"] / hf_tps, greedy_agreement_steps=next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))))
    if "offline" in figures:
        res["offline"] = offline(path, args.scale, vocab, (100, 1024) if not args.tiny else (8, 24), engine_kw)
    if "prefix" in figures:
        sizes = (2048, 128, 256) if not args.tiny else (48, 6, 8)
        res["prefix"] = shared_prefix(path, args.scale, vocab, sizes, engine_kw)
    return res


def table(results: dict) -> list[str]:
    rows = [f"copy bandwidth {results['copy_GBps']:.1f} GB/s on {results['device']}"]
    if "published_params_B" in results:
        rows.append(f"published shapes (meta device), billions of parameters: {results['published_params_B']}")
    for name, r in results["models"].items():
        if "error" in r:
            rows.append(f"{name:9s} error: {r['error']}")
            continue
        if "decode_tok_s" in r:
            rows.append(f"{name:9s} decode bs1 {r['decode_tok_s']:.1f} tok/s; ceiling {r['ceiling_tok_s']:.1f}; "
                        f"ratio {r['decode_ratio']:.3f}")
        if "hf_eager_tok_s" in r:
            rows.append(f"{name:9s} transformers eager generate {r['hf_eager_tok_s']:.1f} tok/s"
                        + (f" (engine x{r['vs_hf']:.1f}; same greedy tokens for {r['greedy_agreement_steps']} "
                           f"of {r['hf_steps']} steps)" if "vs_hf" in r else ""))
        if "offline" in r:
            rows.append(f"{name:9s} offline {r['offline']['tok_s']:.1f} tok/s ({r['offline']['requests']} requests)")
        if "prefix" not in r:
            continue
        p = r["prefix"]
        rows.append(f"{name:9s} shared prefix: cache on {p['cache_on']['tok_s']:.1f} tok/s (hit "
                    f"{p['cache_on']['hit_rate']:.2f} of ideal {p['ideal_hit_rate']:.2f}), off "
                    f"{p['cache_off']['tok_s']:.1f} tok/s; speed-up {p['speedup']:.2f}x")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="9b,35b-a3b")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--hf-steps", type=int, default=64, help="steps of transformers' generate (eager is slow)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrinks the request counts (a quick look)")
    ap.add_argument("--moe-layers", type=int, default=None, help="keep the first N layers of 35b-a3b")
    ap.add_argument("--figures", default="decode,peer,offline,prefix",
                    help="which figures (one device call is at most 10 minutes: split them over calls)")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: from free memory)")
    ap.add_argument("--tiny", action="store_true", help="toy shapes, every step, on CPU without a GPU")
    ap.add_argument("--fp8", action="store_true", help="the published FP8 checkpoint layout, FP8-resident weights")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        ap.error("without a GPU only --tiny runs")
    engine_kw: dict[str, Any] = {}
    if args.max_total_tokens:
        engine_kw["max_total_tokens"] = args.max_total_tokens
    if args.fp8:  # resident on the CPU too (CUDA's default for an FP8 checkpoint)
        engine_kw["quantization"] = "fp8"
    if args.tiny:
        args.models, args.steps, args.hf_steps, args.scale = "tiny,tiny-moe", 16, 16, 1 / 32
        engine_kw.setdefault("max_total_tokens", 4096)
    bw = copy_bandwidth() if device == "cuda" else cpu_copy_bandwidth()
    results: dict[str, Any] = {"bench": "gpu_qwen35", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                               "copy_GBps": bw / 1e9, "engine": engine_kw, "models": {}}
    if args.tiny:  # the published shapes at least build, at their sizes
        results["published_params_B"] = {name: round(published_parameters(name), 2) for name in ("9b", "35b-a3b")}
    failed = False
    for name in [m for m in args.models.split(",") if m]:
        try:
            results["models"][name] = run_model(name, args, bw, device, engine_kw)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next model
            failed = True
            results["models"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_qwen35.json").write_text(json.dumps(results, indent=2))
    print("\n== gpu_qwen35 ==")
    print("\n".join(table(results)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
