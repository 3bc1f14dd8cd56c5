"""Model registry: the `architectures` name in a checkpoint's config.json -> the class that runs it."""

from __future__ import annotations

from torch import nn

from services.worker.runtime.models.llama import LlamaForCausalLM
from services.worker.runtime.models.qwen3 import Qwen3ForCausalLM
from services.worker.runtime.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architectures entry {architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[architecture]
