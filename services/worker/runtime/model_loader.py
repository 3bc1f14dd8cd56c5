"""Build the model for this TP rank and fill it from the checkpoint's safetensors files.

Tensors are handed to the model as lazy safetensors slices, so each rank reads only the rows or
columns its parameters keep (a 235B checkpoint is never materialised whole on one rank). A block-wise
FP8 checkpoint's quantized weights come wrapped (layers/fp8.py): layers made FP8-resident before the
load (layers/fp8_weights.py; the default on CUDA) copy the fp8 slice and its scales, the others get
the slice dequantized to float32 and copied into the parameter in the model's dtype (the CPU's
default). `--quantization fp8` on an unquantized checkpoint quantizes the linear and MoE layers once
they are loaded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.worker.config import ARCHITECTURES
from services.worker.runtime.kv_scales import is_kv_scale
from services.worker.runtime.layers.fp8 import SCALE_SUFFIX, dequantize_fp8_weights, read_scales
from services.worker.runtime.layers.fp8_weights import make_fp8_resident, quantize_fp8_after_load
from services.worker.runtime.layers.linear import LoadedWeight
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.models.llama import LlamaForCausalLM
from services.worker.runtime.models.qwen3 import Qwen3ForCausalLM
from services.worker.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from services.worker.runtime.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from services.worker.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

INDEX_FILE = "model.safetensors.index.json"

# Model registry: the `architectures` name in a checkpoint's config.json -> the class that runs it.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Hybrid (linear + full attention); the multimodal checkpoints serve their text model.
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architectures entry {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return MODEL_REGISTRY[architecture]


def safetensors_files(model_path: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the shard index, else every *.safetensors."""
    index = model_path / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [model_path / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{INDEX_FILE} names weight files that do not exist: {missing}")
        return files
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path {str(model_path)!r} has no *.safetensors files")
    return files


def iterate_weights(model_path: Path, names: Callable[[str], bool] = lambda _: True) -> Iterator[tuple[str, LoadedWeight]]:
    """(HF name, lazy slice) for every tensor of the checkpoint (those `names` accepts); a slice is valid
    until the next file."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if names(name):
                    yield name, f.get_slice(name)


def checkpoint_scales(config: ModelConfig) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's weight_scale_inv tensors by weight name, read in a pass of their own ({}
    for an unquantized checkpoint)."""
    if config.quantization is None or not config.quantization.from_checkpoint:
        return {}
    return read_scales(iterate_weights(config.path, lambda name: name.endswith(SCALE_SUFFIX)))


def checkpoint_weights(
    config: ModelConfig, scales: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, LoadedWeight]]:
    """What the model loads: the checkpoint's tensors, with an FP8 checkpoint's quantized weights
    wrapped with their scales (layers/fp8.py; `scales`: checkpoint_scales, read here when not given).
    KV-cache scales are not weights (the model runner reads them: runtime/kv_scales.py)."""
    if config.quantization is None or not config.quantization.from_checkpoint:
        return iterate_weights(config.path, _model_weight)
    scales = checkpoint_scales(config) if scales is None else scales
    return dequantize_fp8_weights(iterate_weights(config.path, _model_weight), scales, config.quantization)


def _model_weight(name: str) -> bool:
    return not is_kv_scale(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, device: torch.device | str) -> nn.Module:
    """The model for the current TP rank (see services.worker.runtime.distributed), in config.dtype on device
    (FP8 weights where config.quantization is resident), with every parameter loaded from the checkpoint."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(config.dtype):
        model = model_cls(config)
    fp8 = config.quantization
    scales = checkpoint_scales(config)
    if fp8 is not None and fp8.resident and fp8.from_checkpoint:
        make_fp8_resident(model, scales, fp8.block_size)
    loaded = model.load_weights(checkpoint_weights(config, scales))
    params = set(dict(model.named_parameters()))
    # An FP8 layer's scales fill with its weight (`weight` -> `weight_scale_inv`, `w13_weight` -> ...),
    # and so do its unquantized trailing shards (`weight` -> `weight_tail`, fp8_weights.py).
    loaded |= {name + suffix for name in loaded for suffix in ("_scale_inv", "_tail")} & params
    missing = sorted(params - loaded)
    if missing:
        raise ValueError(f"checkpoint {str(config.path)!r} lacks weights for parameters: {missing}")
    if fp8 is not None and fp8.resident and not fp8.from_checkpoint:
        quantize_fp8_after_load(model, fp8.block_size)
    if fp8 is not None and fp8.resident and torch.device(device).type == "cuda":
        # The full-precision weights the FP8 ones replaced go back to the device, so the KV pool's
        # budget (free memory after the load) counts the FP8 bytes only.
        torch.cuda.empty_cache()
    return model.eval()
