"""How far FP8 activation rounding moves a random Qwen3 checkpoint's prompt log-probs, by shape and init range,
on the CPU with transformers (no GPU, no radixserve kernels): the sensitivity behind the GPU FP8 log-prob rows.

    .venv/bin/python bench/cpu_fp8_sensitivity.py [--shapes 0.6b,8b] [--inits 0.02,0.01]

bench/gpu_fp8_resident.py compares an FP8 checkpoint with the bf16 copy of its dequantized weights: the same
weights, so what differs is the w8a8 products' per-token-group (128) e4m3 rounding of their inputs (and
kernel order). On the Qwen3-8B shape at initializer_range 0.02 that moved the prompt log-probs by 0.38 (mean
|d|), and an FP8 KV cache alone by 0.24, against 0.04 on the 0.6B shape: a random checkpoint deep and wide
enough amplifies any rounding, whatever its source. This bench measures that amplification alone, in
transformers' own Qwen3 on the CPU:
  - the shape's checkpoint built from seed 0 in bf16 (weights ~ N(0, init), as Qwen3Config's
    initializer_range; bench/gpu_common.SHAPES), its decoder layers' `*_proj` weights replaced by their
    128 x 128 block-FP8 dequantized values (kernels/fp8_reference.quantize_block_weight), as the reference
    copy on the GPU holds them;
  - prompt log-probs of bench/gpu_fp8_resident.py's 8 prompts, bf16 activations vs every `*_proj` input
    rounded per token group of 128 to e4m3 and back (per_token_group_quant_fp8_reference): mean and max
    |dlogprob|, and whether each prompt's greedy next token is unchanged.
Each further init range of a shape is the weights before it scaled (by a power of two for 0.02, 0.01, 0.005: the
same e4m3 codes), so the rows differ in the residual branches' gain alone. Prints a table; JSON to bench/out/cpu_fp8_sensitivity.json.
Needs ~17 GB of memory for the 8B shape (bf16 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.fp8_reference import (  # noqa: E402
    dequantize_block_weight,
    dequantize_groups,
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
)

# The scored prompts' lengths (bench/gpu_fp8_resident.py scores the same bench_prompts) and bench/gpu_common.py's
# shapes (copied: that module imports the GPU harness).
PROMPT_LENS = (7, 40, 130, 300, 18, 64, 257, 5)
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
VOCAB = 151936
BLOCK = (128, 128)
OUT = Path(__file__).resolve().parent / "out" / "cpu_fp8_sensitivity.json"


def bench_prompts() -> list[list[int]]:
    """The 8 prompts (PROMPT_LENS) scored here and by bench/gpu_fp8_resident.py, from seed 3."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(10, 150000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def build(shape: str, init: float) -> torch.nn.Module:
    """The shape's Qwen3 in bf16 from seed 0, weights ~ N(0, init) drawn in bf16 tensor by tensor (no
    float32 copy of the whole model), norms at 1; decoder `*_proj` weights block-FP8 dequantized."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         initializer_range=init, **SHAPES[shape])  # fmt: skip
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            for rows in torch.split(torch.arange(p.shape[0]), 4096):  # float32 draws a slab at a time
                p[rows] = (torch.randn((len(rows), *p.shape[1:]), generator=gen) * init).to(p.dtype)
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                q, scale = quantize_block_weight(p, BLOCK)
                p.copy_(dequantize_block_weight(q, scale, BLOCK).to(p.dtype))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its inv_freq was left on meta
    return model.eval()


def rounded_inputs(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that round every decoder `*_proj` input per token group of 128 to e4m3 and back (w8a8)."""

    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        q, scale = per_token_group_quant_fp8_reference(flat, BLOCK[1])
        return (dequantize_groups(q, scale, BLOCK[1]).to(x.dtype).view_as(x),)

    return [
        m.register_forward_pre_hook(hook)
        for name, m in model.named_modules()
        if name.startswith("model.layers.") and name.endswith("_proj")
    ]


def score(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[list[list[float]], list[int]]:
    """Each prompt's log-probs of its tokens 1.. and its greedy next token (on the model's device)."""
    logprobs, nexts = [], []
    device = next(model.parameters()).device
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            logprobs.append(lp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
            nexts.append(int(logits[-1].argmax()))
    return logprobs, nexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.6b,8b")
    parser.add_argument("--inits", default="0.02,0.01", help="init ranges, the first the build's")
    args = parser.parse_args()
    inits = [float(v) for v in args.inits.split(",")]
    prompts = bench_prompts()
    rows = []
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        model = build(shape, inits[0])
        print(f"{shape}: built in {time.perf_counter() - t0:.0f} s", flush=True)
        for before, init in zip([inits[0], *inits], inits):
            if init != before:  # from the last init's weights to this one's
                with torch.no_grad():
                    for p in model.parameters():
                        if p.dim() >= 2:
                            p.mul_(init / before)
            t0 = time.perf_counter()
            ref, ref_next = score(model, prompts)
            handles = rounded_inputs(model)
            a8, a8_next = score(model, prompts)
            for h in handles:
                h.remove()
            diffs = [abs(a - b) for xs, ys in zip(a8, ref) for a, b in zip(xs, ys)]
            row = {
                "shape": shape,
                "init": init,
                "mean_abs_logprob_diff": statistics.fmean(diffs),
                "max_abs_logprob_diff": max(diffs),
                "next_token_same": sum(a == b for a, b in zip(a8_next, ref_next)),
                "prompts": len(prompts),
                "scored_tokens": len(diffs),
            }
            rows.append(row)
            print(f"  init {init}: mean |dlogprob| {row['mean_abs_logprob_diff']:.4f}, max "
                  f"{row['max_abs_logprob_diff']:.3f}, next token same {row['next_token_same']}/{len(prompts)} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        del model
    print(f"\n{'shape':6s} {'init':>6s} {'mean |d|':>9s} {'max |d|':>8s} {'next same':>10s}")
    for r in rows:
        print(f"{r['shape']:6s} {r['init']:6.3f} {r['mean_abs_logprob_diff']:9.4f} {r['max_abs_logprob_diff']:8.3f} "
              f"{r['next_token_same']:>6d}/{r['prompts']}")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=1)
    )
    print(f"JSON: {OUT}")


if __name__ == "__main__":
    main()
