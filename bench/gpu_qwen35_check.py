"""Qwen3.5 (hybrid: Gated DeltaNet + gated attention) on one GPU through the Engine: CUDA graphs and
the Triton GDN kernels give the tokens of the eager and torch paths.

    python bench/gpu_qwen35_check.py [float32,bfloat16]     (from the repository root, on a GPU)

A random small Qwen3.5 (8 layers, three linear-attention layers then one full-attention layer, twice;
head dims 128 as in the real models), built once per machine under /tmp. 5 requests of mixed prompt
lengths and max_new_tokens (the decode batch shrinks 5 -> 1, so several graph sizes and padded rows
are used; prompts over the 64-token chunked prefill, so states carry across chunks), greedy:
- float32 and bf16, triton backend, cuda_graph_max_bs=32 against 0: identical tokens required;
- float32, triton backend (Triton GDN kernels) against the torch backend (gdn_ops.py): identical tokens
  required;
- bf16, triton against torch backend: reported only (different kernels in bf16 may flip a near-tie),
  with each request's first divergence and the largest log-prob difference before it;
- the same 5 prompts sent again (triton backend, graphs on): every repeat resumes one token short of its
  prompt (the first prefill saved the state there, Triton kernels and all) and gives the first wave's
  tokens; required in float32, reported in bf16.
Prints one line per check; with $OUT set the JSON goes to $OUT/gpu_qwen35_check.json. Exit 1 when a
required check fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT, save_random  # noqa: E402
from services.worker.frontend.engine import Engine  # noqa: E402

VOCAB = 32000
PROMPT_LENS = (5, 40, 17, 90, 300)
MAX_NEW = (64, 50, 37, 23, 9)
CHUNK = 64


def build_checkpoint() -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path = Path("/tmp/rs-qwen3_5-small-float32")
    if (path / "config.json").exists():
        return path
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * 2
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=len(kinds),
        layer_types=kinds, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
        initializer_range=0.02, tie_word_embeddings=False,
    )  # fmt: skip
    return save_random(path, Qwen3_5ForCausalLM, config, torch.float32)


def greedy(path: Path, **kw: object) -> tuple[list[list[int]], list[list[float]]]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
    with Engine(str(path), max_total_tokens=16384, chunked_prefill_size=CHUNK, **kw) as e:
        res = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ids = [r["output_ids"] for r in res]
    logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in res]
    return ids, logprobs


def repeat(path: Path, **kw: object) -> dict:
    """The prompts twice, the second wave after the first: its cached tokens and tokens against the first's."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
    with Engine(str(path), max_total_tokens=16384, chunked_prefill_size=CHUNK, **kw) as e:
        first, again = (e.generate(input_ids=prompts, sampling_params=params) for _ in range(2))
    cached = [r["meta_info"]["cached_tokens"] for r in again]
    return {
        "tokens_identical": [r["output_ids"] for r in again] == [r["output_ids"] for r in first],
        "hits_all_but_the_last_token": cached == [n - 1 for n in PROMPT_LENS],
        "first_divergence_per_request": [
            next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
            for a, b in zip(first, again)
        ],
        "max_abs_logprob_diff": 0.0,
        "repeat_cached_tokens": cached,
    }


def compare(a: tuple[list[list[int]], list[list[float]]], b: tuple[list[list[int]], list[list[float]]]) -> dict:
    (ids_a, lp_a), (ids_b, lp_b) = a, b
    diverge = [
        next((i for i, (x, y) in enumerate(zip(xs, ys)) if x != y), None if len(xs) == len(ys) else min(len(xs), len(ys)))
        for xs, ys in zip(ids_a, ids_b)
    ]
    lp_diff = max(
        (abs(x - y) for xs, ys, d in zip(lp_a, lp_b, diverge) for x, y in list(zip(xs, ys))[:d]), default=0.0
    )
    return {"tokens_identical": ids_a == ids_b, "first_divergence_per_request": diverge, "max_abs_logprob_diff": lp_diff}


def timed(fn, path: Path, **kw: object):  # noqa: ANN201 - greedy's result
    """greedy(), with a progress line (an Engine start, graph capture and Triton compiles take tens of s)."""
    t0 = time.perf_counter()
    out = fn(path, **kw)
    print(f"  ran {kw} in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main() -> int:
    path = build_checkpoint()
    results: dict[str, dict] = {}
    required: list[str] = []
    dtypes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["float32", "bfloat16"]
    for dtype in dtypes:
        eager = timed(greedy, path, attention_backend="triton", dtype=dtype, cuda_graph_max_bs=0)
        graphs = timed(greedy, path, attention_backend="triton", dtype=dtype, cuda_graph_max_bs=32)
        torch_backend = timed(greedy, path, attention_backend="torch", dtype=dtype, cuda_graph_max_bs=0)
        results[f"{dtype}_graphs_vs_eager"] = compare(graphs, eager)
        results[f"{dtype}_triton_vs_torch_backend"] = compare(eager, torch_backend)
        results[f"{dtype}_repeat_hits_all_but_the_last_token"] = timed(
            repeat, path, attention_backend="triton", dtype=dtype, cuda_graph_max_bs=32
        )
        required.append(f"{dtype}_graphs_vs_eager")
    if "float32" in dtypes:
        required += ["float32_triton_vs_torch_backend", "float32_repeat_hits_all_but_the_last_token"]
    ok = all(
        results[n]["tokens_identical"] and results[n].get("hits_all_but_the_last_token", True)
        for n in required
    )
    for name, r in results.items():
        tag = "required" if name in required else "reported"
        extra = f"; repeat cached tokens {r['repeat_cached_tokens']}" if "repeat_cached_tokens" in r else ""
        print(f"{name} ({tag}): tokens identical {r['tokens_identical']}; first divergence per request "
              f"{r['first_divergence_per_request']}; max |dlogprob| {r['max_abs_logprob_diff']:.2e}{extra}",
              flush=True)  # fmt: skip
    print(json.dumps({"ok": ok, "results": results}))
    if os.environ.get("OUT"):
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_qwen35_check.json").write_text(json.dumps({"ok": ok, "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
