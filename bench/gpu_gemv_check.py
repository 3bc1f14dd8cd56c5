"""The engine's greedy decoding with single-row linears through the Triton GEMV vs through cuBLAS, in
bfloat16 with CUDA graphs (the configuration P1/P2 run in), on a random Qwen3-0.6B-shaped checkpoint.

    python bench/gpu_gemv_check.py [--model 0.6b] [--steps 32]

bf16 greedy sequences of two numerically different (but equally valid) products part at near-ties, so
the check is on log-probs, at the positions before two sequences first differ (same context, same
token). The reference is the same checkpoint run in float32 (weights widened exactly; the GEMV is not
used there): the GEMV's bf16 log-probs may stray from float32 by no more than cuBLAS's bf16 log-probs
do (times SLACK, plus FLOOR for positions where cuBLAS happens to land very close). A wrong product
moves log-probs by whole units from the first token on.
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
from services.worker.frontend.engine import Engine  # noqa: E402

SLACK, FLOOR = 1.5, 0.02


def run(
    path: str, backend: str, prompts: list[list[int]], steps: int, dtype: str | None = None
) -> list[tuple[list[int], list[float]]]:
    params = {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}
    with Engine(path, max_total_tokens=8192, gemv_backend=backend, dtype=dtype) as engine:
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
    exact = run(path, "cublas", prompts, args.steps, dtype="float32")
    cublas, gemv = run(path, "cublas", prompts, args.steps), run(path, "triton", prompts, args.steps)

    def deviation(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> tuple[int, float]:
        """(first differing position, max |delta log-prob| before it)."""
        same = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), len(a[0]))
        return same, max((abs(x - y) for x, y in zip(a[1][:same], b[1][:same])), default=0.0)

    rows, ok = [], True
    for e, c, g in zip(exact, cublas, gemv):
        same_c, dev_c = deviation(c, e)
        same_g, dev_g = deviation(g, e)
        same_cg, dev_cg = deviation(g, c)
        # Compare over the positions all three share, so both deviations see the same contexts.
        n = min(same_c, same_g)
        dev_c_n = deviation((c[0][:n], c[1][:n]), (e[0][:n], e[1][:n]))[1]
        dev_g_n = deviation((g[0][:n], g[1][:n]), (e[0][:n], e[1][:n]))[1]
        good = dev_g_n <= SLACK * dev_c_n + FLOOR
        ok &= good
        rows.append({"shared_with_fp32": n, "cublas_vs_fp32": dev_c_n, "gemv_vs_fp32": dev_g_n,
                     "first_difference_gemv_cublas": same_cg, "gemv_vs_cublas": dev_cg,
                     "first_difference_cublas_fp32": same_c, "first_difference_gemv_fp32": same_g, "pass": good})
    print(f"gemv triton vs cublas vs float32, bf16, graphs, {len(prompts)} prompts x {args.steps}:")
    for r in rows:
        print(f"  {r}")
    print(f"GEMV's bf16 log-probs within {SLACK} x cuBLAS's distance from float32 + {FLOOR}: "
          f"{'PASS' if ok else 'FAIL'}")
    worst = max(r["gemv_vs_cublas"] for r in rows)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_gemv_check.json").write_text(json.dumps({"rows": rows, "worst": worst, "pass": ok}, indent=1))


if __name__ == "__main__":
    main()
