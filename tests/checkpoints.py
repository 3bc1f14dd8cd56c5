"""Tiny seeded random HF checkpoints, written by transformers' own model classes.

They are real checkpoint directories (config.json, safetensors, generation_config.json, optionally a
tokenizer), so everything that loads a user's model loads these, and HF transformers on the same
directory is the reference our outputs are compared with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB_SIZE = 300
# Special tokens come first in the tokenizer, so their ids are fixed: 0, 1, 2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A radix tree shares prefixes; the cache keeps the keys and values of every prefix it has seen.",
    "Continuous batching admits new requests while others are still decoding tokens.",
    "hello world, hello radixserve! 0123456789 + - * / = ( ) [ ] { } < > ? :",
)
# What a real Qwen3 generation_config.json carries: sampling defaults and extra EOS ids.
QWEN3_GENERATION = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "temperature": 0.6, "top_p": 0.95, "top_k": 20}

# A larger init than HF's 0.02 makes attention and routing matter, so a wrong mask or a wrong expert
# changes the logits visibly.
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=IM_START_ID,
    eos_token_id=IM_END_ID,
    pad_token_id=ENDOFTEXT_ID,
)


def tiny_qwen3_config(**overrides: Any) -> Qwen3Config:
    """Qwen3 with 2 layers, 4 heads (2 KV heads), head_dim 16, untied, rope theta 1e6."""
    kwargs = {**_COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    kwargs["tie_word_embeddings"] = False
    return Qwen3Config(**{**kwargs, **overrides})


def tiny_qwen3_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """Qwen3-MoE with 3 layers: 8 experts top-2 (renormalised) on layers 0 and 2, dense layer 1."""
    kwargs = {
        **_COMMON,
        "num_hidden_layers": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    }
    return Qwen3MoeConfig(**{**kwargs, **overrides})


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """SmolLM2-like Llama: tied embeddings, rope theta 1e5, no biases."""
    kwargs = {
        **_COMMON,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    }
    return LlamaConfig(**{**kwargs, **overrides})


# Qwen3.5's linear-attention (Gated DeltaNet) geometry: 2 q/k heads of 16, 4 v heads of 8 (GQA), conv 4.
_QWEN3_5_LINEAR: dict[str, Any] = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
)


def tiny_qwen3_5_config(**overrides: Any) -> Qwen3_5TextConfig:
    """Qwen3.5 dense with 4 layers: full, linear, linear, full attention; untied."""
    kwargs = {
        **_COMMON,
        **_QWEN3_5_LINEAR,
        "num_hidden_layers": 4,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "tie_word_embeddings": False,
    }
    return Qwen3_5TextConfig(**{**kwargs, **overrides})


def tiny_qwen3_5_moe_config(**overrides: Any) -> Qwen3_5MoeTextConfig:
    """Qwen3.5-MoE with 3 layers (linear, full, linear attention): 8 experts top-2 and a shared expert."""
    kwargs = {
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
        **_QWEN3_5_LINEAR,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "tie_word_embeddings": False,
    }
    return Qwen3_5MoeTextConfig(**{**kwargs, **overrides})


_MODEL_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    Qwen3Config: Qwen3ForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
    LlamaConfig: LlamaForCausalLM,
    Qwen3_5TextConfig: Qwen3_5ForCausalLM,
    Qwen3_5MoeTextConfig: Qwen3_5MoeForCausalLM,
}


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (at most VOCAB_SIZE ids) with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[IM_START_ID],
        eos_token=SPECIAL_TOKENS[IM_END_ID],
        pad_token=SPECIAL_TOKENS[ENDOFTEXT_ID],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_checkpoint(
    path: Path,
    config: PretrainedConfig,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    generation: dict[str, Any] | None = None,
    tokenizer: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build the HF model for `config` from torch seed `seed` and save it to `path` (created).

    max_shard_size (e.g. '40KB') splits the weights over several files with an index;
    generation replaces generation_config.json; tokenizer adds a tokenizer.
    """
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[type(config)](config).to(dtype)
    if max_shard_size is None:
        model.save_pretrained(str(path))
    else:
        model.save_pretrained(str(path), max_shard_size=max_shard_size)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer:
        write_tokenizer(path)
    return path
