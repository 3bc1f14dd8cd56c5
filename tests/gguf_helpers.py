"""A tiny Llama written the way llama.cpp's converter writes a GGUF, for the model-fetch tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    """A seeded random 2-layer Llama with grouped KV heads and a non-default rope base."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: half-split rotary -> adjacent pairs."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model: LlamaForCausalLM, path: Path) -> None:
    """Write `model` the way llama.cpp's converter does (names, metadata, permuted q/k), in F32."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    hf_to_gguf = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in model.state_dict().items():
        weight = tensor.float().numpy().copy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            gguf_name = f"blk.{layer}.{hf_to_gguf[module]}.weight"
            if module == "self_attn.q_proj":
                weight = llama_cpp_permute(weight, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                weight = llama_cpp_permute(weight, cfg.num_key_value_heads)
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
