"""Speculative decoding on the GPU, batch 1: speedup against mean accepted length.

Random weights agree with nothing, so acceptance is made a dial. The draft is the target's own first
`--draft-layers` decoder layers with its embedding, final norm and LM head (a cheap model: at 8B with
2 layers it reads ~12 % of the target's bytes per token). The target's deeper layers have their
residual-branch outputs (o_proj and down_proj) scaled by eps, in place on the loaded model: at eps 0
the deeper layers add nothing and the draft predicts the target exactly (the upper bound of the
mechanism), at eps 1 the target is the untouched random model and the draft is a mismatched guesser
(the overhead floor); between them the mean accepted length sweeps down. Plain decoding (CUDA graphs,
overlap) is timed on the same loaded target at each eps, and its greedy tokens are compared.

    python bench/gpu_spec.py [--model 8b] [--draft-layers 2] [--k 4] [--steps 128] [--eps 1,0.1,...]
                             [--gemv-backend auto|triton|cublas]
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

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.gpu_common import OUT, build_checkpoint  # noqa: E402
from services.worker.config import EngineConfig  # noqa: E402
from services.worker.frontend.scheduler_loop import SchedulerLoop  # noqa: E402
from services.worker.scheduler.req import Req  # noqa: E402
from services.worker.scheduler.scheduler import Scheduler  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

POOL = 65536
EPSILONS = (1.0, 0.1, 0.06, 0.045, 0.03, 0.01, 0.0)


def build_layer_draft(target: Path, layers: int) -> Path:
    """The target's embedding, first `layers` decoder layers, final norm and LM head, as a checkpoint."""
    path = Path(f"{target}-first{layers}")
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (path / "config.json").write_text(json.dumps(config))
    keep: dict[str, torch.Tensor] = {}
    for file in sorted(target.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                    continue
                keep[name] = f.get_tensor(name)
    save_file(keep, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def scale_deep_layers(scheduler: Scheduler, first: int, factor: float) -> None:
    """Multiply the residual-branch output weights of target layers >= first by factor, in place (the
    CUDA graphs keep reading the same tensors)."""
    for layer in scheduler.runner.model.model.layers[first:]:
        layer.self_attn.o_proj.weight.mul_(factor)
        layer.mlp.down_proj.weight.mul_(factor)


def generate(scheduler: Scheduler, prompt: list[int], steps: int, rid: str) -> tuple[float, Req]:
    """Greedy batch-1 generation; seconds from the first token (the prefill's) to the last."""
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    params.normalize()
    req = Req(rid, prompt, params, seed=0)
    scheduler.add_request(req)
    while not req.output_ids:
        scheduler.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while scheduler.has_work():
        scheduler.step()
    return time.perf_counter() - start, req


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="8b", choices=["8b", "0.6b"])
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--gemv-backend", default="auto", choices=["auto", "triton", "cublas"])
    ap.add_argument("--eps", default=",".join(str(e) for e in EPSILONS),
                    help="comma-separated scales of the deep layers to sweep, from 1 down to 0")
    args = ap.parse_args()
    target = build_checkpoint(args.model, torch.bfloat16)
    draft = build_layer_draft(target, args.draft_layers)
    config = EngineConfig(
        model_path=str(target), max_total_tokens=POOL, speculative_algorithm="draft",
        speculative_draft_model_path=str(draft), speculative_num_draft_tokens=args.k,
        gemv_backend=args.gemv_backend,
    )
    scheduler = SchedulerLoop(config, 0, "tcp://127.0.0.1:0").scheduler
    spec = scheduler.spec
    prompt = list(range(1000, 1128))
    rows = []
    current = 1.0
    for eps in [float(e) for e in args.eps.split(",")]:
        scale_deep_layers(scheduler, args.draft_layers, eps / current if current else 0.0)
        current = eps
        # Plain decoding on the same target, as the engine runs it without speculation (overlap on).
        scheduler.spec, scheduler.overlap = None, True
        generate(scheduler, prompt[:64], 16, f"warm-plain-{eps}")
        plain_s, plain = generate(scheduler, prompt, args.steps, f"plain-{eps}")
        scheduler.spec, scheduler.overlap = spec, False
        generate(scheduler, prompt[:64], 16, f"warm-spec-{eps}")
        spec_s, sped = generate(scheduler, prompt, args.steps, f"spec-{eps}")
        metrics = sped.spec_metrics() or (1.0, 0.0)
        same = next((i for i, (a, b) in enumerate(zip(plain.output_ids, sped.output_ids)) if a != b), None)
        rows.append({
            "eps": eps, "plain_tok_s": args.steps / plain_s, "spec_tok_s": args.steps / spec_s,
            "speedup": plain_s / spec_s, "accept_length": metrics[0], "accept_rate": metrics[1],
            "first_difference": same,
        })
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"gpu_spec_k{args.k}_{args.gemv_backend}.json").write_text(json.dumps(rows, indent=2))
    print(f"\n== gpu_spec (Qwen3-{args.model}-shaped bf16, batch 1, draft = first {args.draft_layers} layers, "
          f"k={args.k}, {args.steps} tokens) ==")
    print(f"{'eps':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accept len':>10} {'rate':>5}  tokens")
    for r in rows:
        same = "identical" if r["first_difference"] is None else f"differ from token {r['first_difference']}"
        print(f"{r['eps']:5.2f} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:10.1f} {r['speedup']:6.2f}x "
              f"{r['accept_length']:10.2f} {r['accept_rate']:5.2f}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
