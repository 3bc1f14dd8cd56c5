"""Block-wise FP8 checkpoints for tests: a tiny seeded checkpoint block-quantized to float8_e4m3fn with
weight_scale_inv tensors and transformers' FineGrainedFP8 quantization_config, the way the official
"-FP8" checkpoints are stored, and the naive (block by block) quantizer that makes them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv [ceil(N/bn), ceil(K/bk)]) with each block scaled so its amax is FP8_MAX."""
    bn, bk = block
    n, k = weight.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = (
                weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().amax().clamp(min=1e-12) / FP8_MAX
            )
    expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def is_quantized(name: str) -> bool:
    """The linear weights an official FP8 checkpoint quantizes (not embeddings, norms, lm_head, router):
    every `*_proj.weight`, and Qwen3.5's Gated DeltaNet in_proj_qkv and in_proj_z (Qwen/Qwen3.5-*-FP8 keep
    in_proj_a, in_proj_b, conv1d, A_log, dt_bias and the shared-expert gate in bf16)."""
    return name.endswith(("_proj.weight", ".in_proj_qkv.weight", ".in_proj_z.weight"))


def write_fp8_pair(src: Path, root: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """(FP8 copy of src, plain copy of src holding the FP8 copy's dequantized weights)."""
    fp8_dir, deq_dir = root / "fp8", root / "dequantized"
    for out in (fp8_dir, deq_dir):
        shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    fp8_tensors, deq_tensors = {}, {}
    for name, tensor in tensors.items():
        if is_quantized(name):
            q, scale = quantize_blocks(tensor.float(), block)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale
            deq_tensors[name] = (
                q.float()
                * scale.repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)[
                    :, : q.shape[1]
                ]
            )
        else:
            fp8_tensors[name] = deq_tensors[name] = tensor
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq_tensors, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**QUANT, "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir
