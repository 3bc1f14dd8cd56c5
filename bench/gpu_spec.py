"""Speculative decoding on the GPU, batch 1: speedup against mean accepted length, with the two
bounds of the mechanism — draft = target (everything accepted: the upper bound) and a mismatched
draft of the same shape (little accepted: the overhead floor). Qwen3-0.6B-shaped, bf16, greedy.

    python bench/gpu_spec.py [--k 4] [--steps 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from bench.gpu_common import OUT, SHAPES, build_checkpoint  # noqa: E402
from services.worker.engine import Engine  # noqa: E402

POOL = 65536


def build_other_draft() -> Path:
    """Same shape and vocabulary as the 0.6B target, other random weights."""
    path = Path("/tmp/rs-qwen3-0.6b-bfloat16-seed1")
    if (path / "config.json").exists():
        return path
    config = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         initializer_range=0.1, **SHAPES["0.6b"])
    torch.manual_seed(1)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    del model
    torch.cuda.empty_cache()
    return path


def run(target: Path, steps: int, **kw: object) -> tuple[float, list[int], dict]:
    prompt = list(range(1000, 1128))
    params = {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}
    with Engine(str(target), max_total_tokens=POOL, **kw) as e:
        e.generate(input_ids=prompt[:64], sampling_params={**params, "max_new_tokens": 8})
        t0 = time.perf_counter()
        out = e.generate(input_ids=prompt, sampling_params=params)
        dt = time.perf_counter() - t0
    return steps / dt, out["output_ids"], out["meta_info"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    target = build_checkpoint("0.6b", torch.bfloat16)
    other = build_other_draft()
    rows = []
    base_tps, base_ids, _ = run(target, args.steps)
    rows.append(("plain decode", base_tps, 1.0, None, True))
    for label, draft in (("draft = target (upper bound)", target), ("mismatched draft (floor)", other)):
        tps, ids, meta = run(target, args.steps, speculative_algorithm="draft",
                             speculative_draft_model_path=str(draft), speculative_num_draft_tokens=args.k)
        rows.append((label, tps, tps / base_tps, meta.get("spec_accept_length"), ids == base_ids))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_spec.json").write_text(json.dumps(
        [{"mode": m, "tok_s": t, "speedup": s, "accept_length": a, "identical": i} for m, t, s, a, i in rows],
        indent=2))
    print(f"\n== gpu_spec (Qwen3-0.6B-shaped bf16, batch 1, k={args.k}, {args.steps} tokens) ==")
    for m, t, s, a, i in rows:
        print(f"{m:32s} {t:8.1f} tok/s  {s:5.2f}x  accept length {a}  identical to plain: {i}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
