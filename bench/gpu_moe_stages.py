"""Where the FP8 w8a8 fused MoE leaves its reference, stage by stage (issue 26).

    python bench/gpu_moe_stages.py [--quick]                       (GPU, from the repository root)
    TRITON_INTERPRET=1 python bench/gpu_moe_stages.py --quick      (CPU, small shapes)

w8a8 rounds the intermediate act = silu(gate) * up to bfloat16 and then to e4m3, so any difference in the
first GEMM's float32 sums shows up ~10x larger at the output: 1e-3 of gate_up's rms moves the MoE by
~1.2e-2 (torch-only simulation at Qwen3-30B-A3B's expert shape, 64 tokens), against 2.4e-3 from the
outputs' bfloat16 roundings. bench/gpu_fp8.py saw 1.3e-2 at T = 64 and 300 and 2.6e-3 at T = 1 on the
H200; under the interpreter, once its float32 -> bfloat16 cast rounds to nearest (kernels/
interpreter_compat.py), every T is at 2.4e-3 and every stage below agrees, so what is left is the GPU's.
For each T and each launch shape, one row:
- gate_up: the kernel's first GEMM written in float32 (silu(gate) * up, not rounded) against float64
  sums of the same quantized operands, relative to the rms; `ref_f32` is the reference's float32 error.
- act_bf16 / act_e4m3: share of the intermediate's elements (bfloat16) and of its quantized bytes that
  differ from the reference's.
- down: the second GEMM against float64 on the kernel's own quantized act (the GEMM alone).
- moe: fused_moe against fused_moe_fp8_reference (what bench/gpu_fp8.py checks).
A gate_up error near 1e-3 at T = 64 / 300 and near 1e-6 at T = 1 names the first GEMM's accumulation;
the launch shapes tell whether it goes with BLOCK_M (MMA kind) or with the layout. JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.fp8_gemm import per_token_group_quant_fp8  # noqa: E402
from kernels.fp8_reference import (  # noqa: E402
    dequantize_block_weight,
    dequantize_groups,
    fused_moe_fp8_reference,
    per_token_group_quant_fp8_reference,
    quantize_block_weight,
)
from kernels.fused_moe import _grouped_gemm, fused_moe  # noqa: E402
from kernels.moe_blocks import MoeTiles, align_tokens_by_expert, moe_tiles_for, one_pair_per_block  # noqa: E402

BLOCK = (128, 128)
SHAPES = [MoeTiles(16, 64, 128, 8, 8, 3), MoeTiles(32, 64, 64, 8, 4, 3), MoeTiles(64, 64, 128, 8, 8, 3)]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def per_pair(a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """a[p] @ w[experts[p]].T for every pair p, in a's dtype, expert by expert."""
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    for e in torch.unique(experts).tolist():
        rows = torch.nonzero(experts == e).flatten()
        out[rows] = a[rows] @ w[e].to(a.dtype).t()
    return out


def stages(x, w13, w2, w13_s, w2_s, weights, ids, tiles: MoeTiles) -> dict:
    t, top_k = ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    pairs, experts = t * top_k, ids.reshape(-1)
    ppb = one_pair_per_block(t, top_k, num_experts)
    if ppb:  # as fused_moe lays one pair per block out: the kernel reads the experts from topk_ids
        gemm = (experts.contiguous(),) * 3
    else:
        gemm = align_tokens_by_expert(ids, num_experts, tiles.block_m)
    kw = dict(block_size=BLOCK, quantize_a=True, pair_per_block=ppb)
    act32 = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    _grouped_gemm(x, w13, act32, *gemm, None, top_k, True, tiles, w13_s, **kw)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, *gemm, None, top_k, True, tiles, w13_s, **kw)
    xq, xs = per_token_group_quant_fp8_reference(x, BLOCK[1])
    xd = dequantize_groups(xq, xs, BLOCK[1])[torch.arange(pairs, device=x.device) // top_k]
    w13f = dequantize_block_weight(w13, w13_s, BLOCK)
    acts = {}
    for dtype in (torch.float64, torch.float32):
        gate_up = per_pair(xd.to(dtype), w13f, experts)
        acts[dtype] = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    act_ref = acts[torch.float32].to(x.dtype)
    rms = acts[torch.float64].pow(2).mean().sqrt()
    q, s = per_token_group_quant_fp8(act, BLOCK[1])
    q_ref, _ = per_token_group_quant_fp8_reference(act_ref, BLOCK[1])
    down = torch.empty((pairs, w2.shape[1]), dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, *gemm, weights.reshape(-1).contiguous(), 1, False, tiles, w2_s, **kw)
    down_ref = per_pair(
        dequantize_groups(q, s, BLOCK[1]).double(), dequantize_block_weight(w2, w2_s, BLOCK), experts
    )
    out = fused_moe(x, w13, w2, weights, ids, tiles, w13_scale_inv=w13_s, w2_scale_inv=w2_s, block_size=BLOCK,
                    fp8_activations=True)  # fmt: skip
    return {
        "tiles": asdict(tiles),
        "pair_per_block": ppb,
        "gate_up": float((act32.double() - acts[torch.float64]).pow(2).mean().sqrt() / rms),
        "gate_up_ref_f32": float(
            (acts[torch.float32].double() - acts[torch.float64]).pow(2).mean().sqrt() / rms
        ),
        "act_bf16": float((act != act_ref).float().mean()),
        "act_e4m3": float((q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean()),
        "down": rel(down, down_ref * weights.reshape(-1, 1).double()),
        "moe": rel(out, fused_moe_fp8_reference(x, w13, w2, w13_s, w2_s, BLOCK, weights, ids, True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (8 experts, 256 x 256, top-2)")
    args = parser.parse_args()
    dev = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
    e, h, i, top_k = (8, 256, 256, 2) if args.quick else (128, 2048, 768, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    w13, w13_s = quantize_block_weight(torch.randn(e, 2 * i, h, device=dev, generator=g) * 0.02, BLOCK)
    w2, w2_s = quantize_block_weight(torch.randn(e, h, i, device=dev, generator=g) * 0.02, BLOCK)
    rows = []
    for t in (1, 64) if args.quick else (1, 64, 300):
        x = torch.randn(t, h, device=dev, generator=g).bfloat16()
        logits = torch.randn(t, e, device=dev, generator=g)
        weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).float()
        default = moe_tiles_for(t * top_k, e, fp8=True)
        for tiles in [default] + [s for s in SHAPES if s != default]:
            tiles = replace(tiles, block_k=min(tiles.block_k, BLOCK[1]))
            row = {"t": t, "default": tiles == default} | stages(x, w13, w2, w13_s, w2_s, weights, ids, tiles)
            rows.append(row)
            shape = f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}/{tiles.num_warps}w"
            print(f"T={t:<4}{shape:<16}{'*' if row['default'] else ' '} gate_up {row['gate_up']:.2e} "
                  f"(ref f32 {row['gate_up_ref_f32']:.2e})  act bf16 != {row['act_bf16']:.4f}  "
                  f"e4m3 != {row['act_e4m3']:.4f}  down {row['down']:.2e}  moe {row['moe']:.2e}",
                  flush=True)  # fmt: skip
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gpu_moe_stages.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
