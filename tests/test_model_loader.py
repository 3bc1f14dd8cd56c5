"""ModelConfig and load_model on real checkpoint directories: file layouts, tied heads, dtypes, config
naming variants, generation defaults and the errors a bad directory gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.worker.config import ARCHITECTURES
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import MODEL_REGISTRY, get_model_class, load_model
from tests.checkpoints import ENDOFTEXT_ID, IM_END_ID, tiny_llama_config, write_checkpoint
from tests.forward_helpers import BatchDriver

PROMPT = [5, 17, 250, 42, 9, 99, 123, 7, 64, 200, 11, 3]


def prefill_logits(path: Path, dtype: str = "float32") -> torch.Tensor:
    config = ModelConfig.from_path(path, dtype=dtype)
    driver = BatchDriver(load_model(config, "cpu"), config)
    return driver.extend([(driver.new_request(), PROMPT)], return_all_logits=True)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def copy_with_config(src: Path, dst: Path, edit: dict, drop: tuple[str, ...] = ()) -> Path:
    """A copy of checkpoint src whose config.json has `edit` applied and the `drop` keys removed."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(edit)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_sharded_checkpoint_gives_identical_logits_to_single_file(
    qwen3_path: Path, qwen3_sharded_path: Path
) -> None:
    assert (qwen3_sharded_path / "model.safetensors.index.json").is_file()
    assert len(list(qwen3_sharded_path.glob("*.safetensors"))) > 1
    assert torch.equal(prefill_logits(qwen3_sharded_path), prefill_logits(qwen3_path))


@pytest.mark.parametrize("fixture", ["qwen3_tied_path", "llama_path"])
def test_tied_checkpoint_shares_embedding_and_lm_head(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    config = ModelConfig.from_path(path)
    assert config.tie_word_embeddings
    model = load_model(config, "cpu")
    assert model.lm_head is model.model.embed_tokens
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert relative_error(prefill_logits(path), ref) <= 1e-4


def test_untied_checkpoint_loads_its_own_lm_head(qwen3_path: Path) -> None:
    config = ModelConfig.from_path(qwen3_path)
    assert not config.tie_word_embeddings
    model = load_model(config, "cpu")
    checkpoint = load_file(str(qwen3_path / "model.safetensors"))
    vocab = config.vocab_size
    assert torch.equal(model.lm_head.weight[:vocab], checkpoint["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight[:vocab], checkpoint["model.embed_tokens.weight"])
    assert not torch.equal(model.lm_head.weight[:vocab], model.model.embed_tokens.weight[:vocab])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_in_that_dtype_and_stays_close_to_float32(
    qwen3_moe_path: Path, dtype: str
) -> None:
    config = ModelConfig.from_path(qwen3_moe_path, dtype=dtype)
    assert config.dtype == getattr(torch, dtype)
    model = load_model(config, "cpu")
    assert {p.dtype for p in model.parameters()} == {config.dtype}
    driver = BatchDriver(model, config)
    logits = driver.extend([(driver.new_request(), PROMPT)], return_all_logits=True)
    assert logits.dtype == torch.float32
    assert relative_error(logits, prefill_logits(qwen3_moe_path)) < 5e-2


def test_dtype_auto_is_float32_on_cpu(qwen3_path: Path) -> None:
    assert ModelConfig.from_path(qwen3_path).dtype == torch.float32
    assert ModelConfig.from_path(qwen3_path, dtype="auto").dtype == torch.float32
    assert ModelConfig.from_path(qwen3_path, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_unsupported_dtype_is_a_value_error(qwen3_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_path(qwen3_path, dtype="int8")


def test_unknown_architecture_is_a_value_error_naming_architectures(qwen3_path: Path, tmp_path: Path) -> None:
    path = copy_with_config(qwen3_path, tmp_path / "unknown", {"architectures": ["MysteryForCausalLM"]})
    with pytest.raises(ValueError, match="architectures") as err:
        ModelConfig.from_path(path)
    assert "Qwen3ForCausalLM" in str(err.value)


def test_every_accepted_architecture_has_a_model_class() -> None:
    # ModelConfig accepts the names in ARCHITECTURES; the loader must have a class for each, no more.
    assert set(MODEL_REGISTRY) == ARCHITECTURES
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("MysteryForCausalLM")


def test_missing_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_path(tmp_path)


def test_checkpoint_missing_a_tensor_is_a_value_error(qwen3_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "incomplete"
    shutil.copytree(qwen3_path, path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        load_model(ModelConfig.from_path(path), "cpu")


def test_generation_config_supplies_sampling_defaults_and_extra_eos(
    qwen3_path: Path, llama_path: Path
) -> None:
    qwen3 = ModelConfig.from_path(qwen3_path)
    assert qwen3.generation_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert qwen3.eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)
    llama = ModelConfig.from_path(llama_path)
    assert llama.generation_defaults == {}
    assert llama.eos_token_ids == (IM_END_ID,)


def test_config_fields_describe_the_checkpoint(qwen3_moe_path: Path) -> None:
    config = ModelConfig.from_path(qwen3_moe_path)
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert (config.num_layers, config.num_attention_heads, config.num_kv_heads) == (3, 4, 2)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (16, 64, 300)
    assert config.num_experts == 8
    assert config.context_len == 256
    assert [config.num_kv_heads_per_rank(tp) for tp in (1, 2, 4)] == [2, 1, 1]


def test_context_length_override_is_bounded_by_the_model(qwen3_path: Path) -> None:
    assert ModelConfig.from_path(qwen3_path, context_length=128).context_len == 128
    with pytest.raises(ValueError, match="context_length"):
        ModelConfig.from_path(qwen3_path, context_length=100_000)


def test_classic_config_naming_gives_the_same_model(qwen3_moe_path: Path, tmp_path: Path) -> None:
    # Checkpoints written before transformers 5 name rope theta, dtype and expert count differently.
    classic = copy_with_config(
        qwen3_moe_path,
        tmp_path / "classic",
        {"rope_theta": 1_000_000.0, "rope_scaling": None, "torch_dtype": "float32", "num_experts": 8},
        drop=("rope_parameters", "dtype", "num_local_experts"),
    )
    config = ModelConfig.from_path(classic)
    assert config.num_experts == 8
    assert torch.equal(prefill_logits(classic), prefill_logits(qwen3_moe_path))


def test_rope_theta_is_read_from_the_checkpoint(qwen3_path: Path, tmp_path: Path) -> None:
    other_theta = copy_with_config(
        qwen3_path, tmp_path / "theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
    )
    assert relative_error(prefill_logits(other_theta), prefill_logits(qwen3_path)) > 1e-3


@pytest.mark.parametrize(
    ("fixture", "rope"),
    [
        (
            "llama_path",
            {
                "rope_type": "llama3",
                "rope_theta": 100_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        (
            "qwen3_path",
            {
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_scaled_rope_matches_hf(
    fixture: str, rope: dict, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    original: Path = request.getfixturevalue(fixture)
    path = copy_with_config(original, tmp_path / "scaled", {"rope_parameters": rope})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    logits = prefill_logits(path)
    assert relative_error(logits, ref) <= 1e-4
    assert relative_error(logits, prefill_logits(original)) > 1e-3, "the scaling must change the model"


def test_attention_and_mlp_biases_are_loaded(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "biased", tiny_llama_config(attention_bias=True, mlp_bias=True), seed=5
    )
    # HF initialises biases to zero; random ones make a dropped bias visible.
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    biases = [name for name in tensors if name.endswith(".bias")]
    assert len(biases) == 2 * 7
    for name in biases:
        tensors[name] = 0.1 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert relative_error(prefill_logits(path), ref) <= 1e-4
