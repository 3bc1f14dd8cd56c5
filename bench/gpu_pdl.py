"""Programmatic dependent launch (kernels/pdl.py) on and off, through the Engine, batch-1 decode.

    python bench/gpu_pdl.py [--models 0.6b,8b-fp8,8b] [--rounds 2] [--env RS_PDL]   (GPU, repository root)

For each model (random Qwen3-shaped checkpoints from bench/gpu_common; `8b-fp8` is the 8B one quantized
at load, `quantization="fp8"`, block-wise 128x128), the Engine runs with RS_PDL=0 and RS_PDL=1 in
alternation, --rounds times, CUDA graphs on (the default):
- check: the greedy tokens of 8 prompts (32 new tokens) and the prompt log-probs are identical bit for
  bit with PDL on and off (the kernels compute the same sums in the same order; only when a kernel
  starts changes, so any difference is a missed wait);
- figure: batch-1 decode tok/s (128-token prompt, 256 new tokens) beside the ceiling, the worker's
  resident weight bytes / measured copy bandwidth; best of the rounds for each setting.
Prints a table last; JSON to $OUT/gpu_pdl.json (gpu_pdl_<models>.json for other --models, e.g.
gpu_pdl_06b.json). Exit 1 when a check fails.

--env NAME A/B-tests another switch of the decode kernels the same way (NAME=0 "off" against NAME=1 "on",
PDL on in both): RS_PDL_PRELOAD (GEMVs read their first weight tile before the PDL wait), RS_DECODE_W8
(one request's decode attention at 8 warps a program), RS_ROPE_IN_DECODE (q/k norm, rotary and the KV
store folded into decode attention) or RS_STEP_KERNELS (the step's input fixups and greedy argmax outside
the graph in one launch each, kernels/step_inputs.py), RS_PDL_EARLY_RELEASE (kernels release their
dependents before their wait, kernels/pdl.py), RS_PDL_PRELOAD_SLICE (the small GEMVs read up to three
weight tiles before the wait), RS_GEMV_SPLIT (calibration also times GEMV tiles that split K) or
RS_GEMV_THIN (calibration times thin row blocks too, default 1);
JSON to $OUT/gpu_pdl_<name>[_<models>].json. A switch that changes the order of
a kernel's sums (RS_DECODE_W8, RS_GEMV_SPLIT, RS_GEMV_THIN) changes the tokens too, so the check is reported, not required, for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, build_checkpoint, copy_bandwidth  # noqa: E402
from bench.gpu_fp8_resident import run as fp8_resident_run  # noqa: E402

# Switches that change the order of a kernel's sums: their tokens may differ, so the check is not required.
DEFAULT_MODELS = "0.6b,8b-fp8,8b"
REORDERING_SWITCHES = {"RS_DECODE_W8", "RS_GEMV_SPLIT", "RS_GEMV_THIN"}


def run(path: Path, env: str, on: bool, **kw: object) -> dict:
    """bench/gpu_fp8_resident.py's run (greedy tokens of 8 prompts, prompt log-probs, resident weight
    bytes, batch-1 decode tok/s) with the switch `env` on or off."""
    os.environ[env] = "1" if on else "0"
    result = fp8_resident_run(path, **kw)
    print(f"  {path.name} {kw} {env}={int(on)}: {result['decode_tok_s']:.1f} tok/s", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--env", default="RS_PDL", help="the switch to A/B (default RS_PDL)")
    args = ap.parse_args()
    # The worker's tiles per weight shape for single-row products (model_runner logs them at INFO): which
    # tiles calibration chose is part of what a run measured.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("services.worker.runtime.model_runner").setLevel(logging.INFO)
    bw = copy_bandwidth()
    results: dict = {"copy_bandwidth_gb_s": bw / 1e9, "env": args.env, "models": {}}
    # Named by the switch and the models (two runs of one switch over different models in one call, such as
    # 0.6b then 8b, once wrote the same file and the second replaced the first).
    out_name = ("gpu_pdl" if args.env == "RS_PDL" else f"gpu_pdl_{args.env.lower()}") + (
        "" if args.models == DEFAULT_MODELS else "_" + args.models.replace(",", "_").replace(".", "")
    ) + ".json"
    failed = False
    for name in args.models.split(","):
        base = name.removesuffix("-fp8")
        path = build_checkpoint(base, torch.bfloat16, 0.02)
        kw = {"quantization": "fp8"} if name.endswith("-fp8") else {}
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for pdl in (False, True):
                runs[pdl].append(run(path, args.env, pdl, **kw))
        off, on = runs[False][0], runs[True][0]
        # Each run against the first PDL-off run: a difference between two off runs is not PDL's.
        agree = {
            f"{'on' if pdl else 'off'}{i}": r["tokens"] == off["tokens"] and r["logprobs"] == off["logprobs"]
            for pdl in (False, True)
            for i, r in enumerate(runs[pdl])
        }
        same = all(
            r["tokens"] == off["tokens"] and r["logprobs"] == off["logprobs"]
            for r in runs[True] + runs[False]
        )
        failed |= not same and args.env not in REORDERING_SWITCHES
        ceiling = bw / off["weight_bytes"]
        best = {pdl: max(r["decode_tok_s"] for r in runs[pdl]) for pdl in (False, True)}
        results["models"][name] = {
            "identical_on_off": same,
            "agree_with_off0": agree,
            "ceiling_tok_s": ceiling,
            "weight_bytes": off["weight_bytes"],
            "pdl_off_tok_s": [r["decode_tok_s"] for r in runs[False]],
            "pdl_on_tok_s": [r["decode_tok_s"] for r in runs[True]],
            "ratio_off": best[False] / ceiling,
            "ratio_on": best[True] / ceiling,
            "speedup": best[True] / best[False],
            "tokens_equal": on["tokens"] == off["tokens"],
        }
        print(json.dumps({name: results["models"][name]}), flush=True)
        Path(OUT).mkdir(parents=True, exist_ok=True)
        (Path(OUT) / out_name).write_text(json.dumps(results, indent=1))
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; off/on: {args.env}=0/1")
    print(
        f"{'model':10} {'ceiling':>8} {'off tok/s':>10} {'on tok/s':>10} {'off':>6} {'on':>6} {'x':>6} identical"
    )
    for name, r in results["models"].items():
        print(
            f"{name:10} {r['ceiling_tok_s']:8.0f} {max(r['pdl_off_tok_s']):10.1f} {max(r['pdl_on_tok_s']):10.1f} "
            f"{r['ratio_off']:6.3f} {r['ratio_on']:6.3f} {r['speedup']:6.3f} {r['identical_on_off']}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
