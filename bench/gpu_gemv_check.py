"""The engine's greedy decoding with single-row linears through the Triton GEMV vs through cuBLAS, in
bfloat16 with CUDA graphs (the configuration P1/P2 run in), on a random Qwen3-0.6B-shaped checkpoint.

    python bench/gpu_gemv_check.py [--model 0.6b] [--steps 32]

bf16 greedy sequences of two numerically different (but equally valid) products part at near-ties, so
the check is on log-probs: each sequence's chosen tokens' log-probs must agree, position by position,
up to the first differing token, within what bf16 rounding moves them (a wrong product moves them by
whole units from the first token on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, build_checkpoint  # noqa: E402
from services.worker.engine import Engine  # noqa: E402

TOLERANCE = 0.1  # |delta log-prob| of one token between the two bf16 products


def run(path: str, backend: str, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list[float]]]:
    params = {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}
    with Engine(path, max_total_tokens=8192, gemv_backend=backend) as engine:
        out = []
        for ids in prompts:  # one at a time: batch 1, the GEMV's case
            r = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            out.append((r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.6b")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    path = str(build_checkpoint(args.model, torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 150_000, (n,), generator=gen).tolist() for n in (5, 37, 128)]
    ref, got = run(path, "cublas", prompts, args.steps), run(path, "triton", prompts, args.steps)
    rows, worst = [], 0.0
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, got):
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ids))
        diff = max((abs(a - b) for a, b in zip(ref_lp[: same + 1], lp[: same + 1])), default=0.0)
        worst = max(worst, diff)
        rows.append({"first_difference": same, "max_abs_dlogprob": diff})
    ok = worst <= TOLERANCE
    print(f"gemv triton vs cublas, bf16, graphs, {len(prompts)} prompts x {args.steps}: per prompt "
          f"{rows}; max |dlogprob| up to and at the first differing token {worst:.3g} "
          f"(tolerance {TOLERANCE}): {'PASS' if ok else 'FAIL'}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_gemv_check.json").write_text(json.dumps({"rows": rows, "worst": worst, "pass": ok}, indent=1))


if __name__ == "__main__":
    main()
