"""ModelConfig: what the worker needs to know about a checkpoint directory, read once.

It wraps transformers' own config (so any field a model needs is at hand) and resolves the things
the scheduler and memory pools need: dtype, head counts, context length, EOS ids and the checkpoint's
default sampling parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from services.worker.config import pick_architecture
from services.worker.mem.state_pool import StateShape
from services.worker.runtime.layers.fp8 import Fp8Config, parse_quantization_config, resolve_quantization
from services.worker.runtime.layers.rotary import rope_parameters
from shared.sampling_params import generation_defaults

# Checkpoints whose config.json nests the language model's settings under `text_config` (the vision
# tower beside it is not served).
MULTIMODAL_ARCHITECTURES = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"})
# The mixers a hybrid model's `layer_types` may name.
LAYER_TYPES = ("full_attention", "linear_attention")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return json.load(f)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def resolve_dtype(
    dtype: str | torch.dtype | None, checkpoint_dtype: Any, device: torch.device
) -> torch.dtype:
    """'auto'/None: float32 on CPU (fast and exact there), the checkpoint's dtype (else bfloat16) on
    accelerators."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; use one of {sorted(_DTYPES)}")
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(checkpoint_dtype, torch.dtype):
            return checkpoint_dtype
        return _DTYPES.get(str(checkpoint_dtype or "bfloat16").removeprefix("torch."), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint directory's model description (global, not per TP rank, unless a method says)."""

    path: Path
    hf_config: PretrainedConfig = field(repr=False)
    architecture: str
    dtype: torch.dtype
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_len: int
    tie_word_embeddings: bool
    num_experts: int  # 0 for dense models
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any]
    # Each layer's mixer: 'full_attention' (KV pool) or 'linear_attention' (StatePool); all
    # 'full_attention' unless the checkpoint is a hybrid model.
    layer_types: tuple[str, ...] = ()
    # The weights' block-wise FP8 scheme (layers/fp8.py): an FP8 checkpoint's, or `--quantization fp8`'s;
    # None for unquantized weights.
    quantization: Fp8Config | None = None

    @classmethod
    def from_path(
        cls,
        model_path: str | Path,
        dtype: str | torch.dtype | None = None,
        context_length: int | None = None,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
    ) -> ModelConfig:
        """quantization: `--quantization` (None: the checkpoint's own; see layers/fp8.py)."""
        path = Path(model_path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model_path {str(path)!r} has no config.json")
        raw = _read_json(config_file)
        architecture = pick_architecture(raw.get("architectures"))
        hf_config = AutoConfig.from_pretrained(path)
        tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if architecture in MULTIMODAL_ARCHITECTURES:
            # tie_word_embeddings belongs to the outer config there; the rest to the text model.
            hf_config = hf_config.get_text_config()
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=true in config.json is not supported")

        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or raw.get("torch_dtype")
        generation = (
            _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        )
        eos = (
            _as_id_list(raw.get("eos_token_id"))
            + _as_id_list((raw.get("text_config") or {}).get("eos_token_id"))
            + _as_id_list(generation.get("eos_token_id"))
        )
        num_experts = int(
            getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0
        )

        return cls(
            path=path,
            hf_config=hf_config,
            architecture=architecture,
            dtype=resolve_dtype(dtype, checkpoint_dtype, torch.device(device)),
            num_layers=int(hf_config.num_hidden_layers),
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(hf_config.vocab_size),
            context_len=_context_len(hf_config, context_length),
            tie_word_embeddings=tie_word_embeddings,
            num_experts=num_experts,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            generation_defaults=generation_defaults(generation),
            layer_types=_layer_types(hf_config),
            quantization=resolve_quantization(
                parse_quantization_config(raw.get("quantization_config")), quantization, torch.device(device).type
            ),
        )

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (with per-request state, see mem/state_pool.py)."""
        return "linear_attention" in self.layer_types

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV buffer (all of them in a model without linear attention)."""
        if not self.is_hybrid:
            return self.num_layers
        return sum(1 for kind in self.layer_types if kind == "full_attention")

    def state_shape(self, tp_size: int = 1) -> StateShape:
        """A hybrid model's per-request linear-attention state on one of tp_size ranks (StatePool's
        geometry: each rank keeps its share of the heads)."""
        hf = self.hf_config
        key_dim = int(hf.linear_num_key_heads) // tp_size * int(hf.linear_key_head_dim)
        num_v_heads, v_head_dim = int(hf.linear_num_value_heads) // tp_size, int(hf.linear_value_head_dim)
        return StateShape(
            num_layers=self.layer_types.count("linear_attention"),
            conv_dim=2 * key_dim + num_v_heads * v_head_dim,
            conv_width=int(hf.linear_conv_kernel_dim),
            num_v_heads=num_v_heads,
            k_head_dim=int(hf.linear_key_head_dim),
            v_head_dim=v_head_dim,
            conv_dtype=self.dtype,
        )

    def attention_layer_index(self, layer_id: int) -> int:
        """Layer layer_id's KV buffer: its index among the attention layers."""
        return self.layer_types[:layer_id].count("full_attention")

    def linear_layer_index(self, layer_id: int) -> int:
        """Layer layer_id's StatePool tensors: its index among the linear-attention layers."""
        return self.layer_types[:layer_id].count("linear_attention")

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads one rank holds: split across ranks, or one replicated head when tp > kv heads."""
        return max(1, self.num_kv_heads // tp_size)


def _layer_types(hf_config: PretrainedConfig) -> tuple[str, ...]:
    num_layers = int(hf_config.num_hidden_layers)
    kinds = getattr(hf_config, "layer_types", None)
    if not kinds or not any(kind == "linear_attention" for kind in kinds):
        return ("full_attention",) * num_layers
    kinds = tuple(str(kind) for kind in kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={num_layers}")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types names {unknown}; supported: {', '.join(LAYER_TYPES)}")
    return kinds


def _context_len(hf_config: PretrainedConfig, override: int | None) -> int:
    max_positions = int(hf_config.max_position_embeddings)
    if override is None:
        return max_positions
    if override <= 0:
        raise ValueError(f"context_length must be positive, got {override}")
    # Scaled rope (yarn, linear, llama3) is how a checkpoint extends past its trained length.
    rope = rope_parameters(hf_config)
    limit = max_positions
    if "factor" in rope and rope["rope_type"] != "default":
        original = int(rope.get("original_max_position_embeddings") or max_positions)
        limit = max(limit, int(original * float(rope["factor"])))
    if override > limit:
        raise ValueError(f"context_length={override} exceeds the model's max_position_embeddings ({limit})")
    return override
