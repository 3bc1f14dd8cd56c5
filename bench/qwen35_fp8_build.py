"""A seeded random Qwen3.5 checkpoint written directly in the published FP8 layout, layer by layer
(bench/gpu_qwen35.py --fp8): the full 40-layer Qwen3.5-35B-A3B is ~35 GB this way (~70 GB in bf16, more
than the one-GPU machine's 64 GB disk), and neither the disk nor the GPU ever holds the bf16 model.

Layout (Qwen/Qwen3.5-*-FP8): transformers' FineGrainedFP8 quantization_config (e4m3, dynamic
activations, weight_block_size) and, beside each quantized weight, its float32 `weight_scale_inv`
(layers/fp8.quantize_blocks). Quantized: the decoder layers' `*_proj.weight` (attention q/k/v/o, MLP,
per-expert gate/up/down, shared expert) and the Gated DeltaNet's in_proj_qkv and in_proj_z. Stored in
bf16: embeddings, LM head, norms, the router (`mlp.gate`), shared_expert_gate, in_proj_a/b, conv1d,
A_log, dt_bias. Experts are stored per expert (`mlp.experts.{e}.gate_proj.weight`), as published.

Weights: the names and shapes of transformers' model for the config (counted on the meta device;
stacked experts written per expert), each tensor drawn on `device` from a generator seeded per layer,
the way transformers' _init_weights draws them: normal(0, initializer_range) for matrices and conv1d,
zeros for the zero-centred RMSNorms, ones for the gated norm and dt_bias, log(uniform(0.01, 16)) for
A_log. One safetensors shard per decoder layer (plus one for the embedding, final norm and LM head) and
model.safetensors.index.json; config.json is written last, so a cut-off build is redone.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from services.worker.runtime.layers.fp8 import quantize_blocks

QUANTIZED = re.compile(r"^model\.layers\.\d+\..*(_proj|\.in_proj_qkv|\.in_proj_z)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


def published_shapes(model_class: type, config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """{checkpoint name: shape} of the model in the published per-expert layout (meta device)."""
    with torch.device("meta"):
        model = model_class(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        match = _STACKED.match(name)
        if match is None:
            shapes[name] = tuple(tensor.shape)
            continue
        experts, rows, cols = tensor.shape
        for e in range(experts):
            if match.group(2) == "down_proj":
                shapes[f"{match.group(1)}.{e}.down_proj.weight"] = (rows, cols)
            else:
                shapes[f"{match.group(1)}.{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{match.group(1)}.{e}.up_proj.weight"] = (rows // 2, cols)
    return shapes


def init_tensor(
    name: str, shape: tuple[int, ...], std: float, gen: torch.Generator, device: str
) -> torch.Tensor:
    """One tensor as transformers' Qwen3.5 _init_weights draws it, in bf16 (float32 draws)."""
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
        out = torch.zeros(shape, device=device)  # zero-centred RMSNorm: scale 1 + weight
    elif name.endswith(("linear_attn.norm.weight", ".dt_bias")):
        out = torch.ones(shape, device=device)
    elif name.endswith(".A_log"):
        out = torch.empty(shape, device=device).uniform_(0.01, 16, generator=gen).log_()
    else:
        out = torch.empty(shape, device=device).normal_(0.0, std, generator=gen)
    return out.to(torch.bfloat16)


def _group(name: str) -> int | None:
    match = _LAYER.match(name)
    return None if match is None else int(match.group(1))


def write_fp8_checkpoint(
    path: Path, model_class: type, config: PretrainedConfig, block: tuple[int, int], device: str
) -> Path:
    """Build `path` (once: kept when its config.json exists) from seeded random weights, one decoder
    layer at a time in GPU/CPU memory."""
    if (path / "config.json").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    shapes = published_shapes(model_class, config)
    layers = int(config.num_hidden_layers)
    groups: dict[int, list[str]] = {}
    for name in shapes:
        group = _group(name)
        groups.setdefault(layers if group is None else group, []).append(name)
    std = float(config.initializer_range)
    weight_map: dict[str, str] = {}
    total = 0
    for group in sorted(groups):
        gen = torch.Generator(device=device).manual_seed(1000 + group)
        shard: dict[str, torch.Tensor] = {}
        for name in groups[group]:
            tensor = init_tensor(name, shapes[name], std, gen, device)
            if QUANTIZED.match(name):
                q, scale = quantize_blocks(tensor, block)
                shard[name], shard[name + "_scale_inv"] = q.cpu(), scale.cpu()
            else:
                shard[name] = tensor.cpu()
            del tensor
        file = f"model-{group + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, file))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    raw = config.to_dict()
    raw.update(
        architectures=[model_class.__name__], dtype="bfloat16", quantization_config=quantization_config(block)
    )
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path
