"""A float8 KV cache's K and V scales, one pair per attention layer, as a checkpoint may carry them.

Quantized checkpoints (llm-compressor's compressed-tensors, NVIDIA ModelOpt, AutoFP8) store calibrated
per-tensor scales for an FP8 KV cache under the attention layer: `model.layers.N.self_attn.k_scale` and
`v_scale` (compressed-tensors), `...self_attn.k_proj.k_scale` and `v_proj.v_scale` (ModelOpt), or one
`...self_attn.kv_scale` for both (older AutoFP8). vLLM and SGLang read them; with kv_cache_dtype fp8
they become the pool's scales (services/worker/mem/memory_pool.py: stored = x / scale), else every
scale is 1.0. A full-precision cache has no use for them, so the model never loads them as weights.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from safetensors import safe_open

from services.worker.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?(k|v|kv)_scale$")


def is_kv_scale(name: str) -> bool:
    return KV_SCALE_NAME.search(name) is not None


def pool_layer_ids(config: ModelConfig, start: int, end: int) -> list[int]:
    """The checkpoint layer index of each of the KV pool's layers, in pool order: the attention layers
    among decoder layers start .. end-1 (a pipeline stage's; a hybrid model's full-attention layers)."""
    if config.is_hybrid:
        return [i for i in range(start, end) if config.layer_types[i] == "full_attention"]
    return list(range(start, end))


def read_kv_scales(files: list[Path], layer_ids: list[int]) -> tuple[list[float], list[float]] | None:
    """(k_scales, v_scales) for the pool layers `layer_ids` (checkpoint layer indices) from the checkpoint
    `files`, or None when it carries no KV scales. Scales for only some of those layers, or a scale
    that is not a finite positive scalar, are a ValueError."""
    found: dict[tuple[int, str], float] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                match = KV_SCALE_NAME.search(name)
                if match is None:
                    continue
                tensor = f.get_tensor(name).float()
                if tensor.numel() != 1 or not bool(tensor.isfinite().all()) or float(tensor) <= 0:
                    raise ValueError(
                        f"checkpoint KV scale {name!r} must be one finite positive value, got {tensor}"
                    )
                layer, kind = int(match[1]), match[2]
                for which in ("k", "v") if kind == "kv" else (kind,):
                    found[(layer, which)] = float(tensor)
    if not found:
        return None
    missing = [
        f"{which}_scale of layer {layer}"
        for layer in layer_ids
        for which in "kv"
        if (layer, which) not in found
    ]
    if missing:
        raise ValueError(f"the checkpoint's KV cache scales are incomplete: no {', '.join(missing)}")
    logger.info("float8 KV cache: K/V scales of %d layers from the checkpoint", len(layer_ids))
    return [found[(layer, "k")] for layer in layer_ids], [found[(layer, "v")] for layer in layer_ids]
