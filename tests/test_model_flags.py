"""The model flags SGLang and vLLM users type, on `radixserve up` and on the single services: the aliases
(--model, --tp/--tensor-parallel-size, --max-model-len), --chunked-prefill-size -1 as off, --dtype half,
--tokenizer-path, --chat-template (a file or inline Jinja), --trust-remote-code, and `up`'s
--served-model-name, --api-key and --log-level, which reach every child in its environment."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from services.launch import add_up_commands, model_settings, run_up
from services.tokenizer.config import TokenizerConfig
from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.frontend.service_config import WorkerServiceConfig
from shared import flags
from shared.prompt_tokenizer import PromptTokenizer
from shared.protocol import ChatMessage
from tests.checkpoints import CHAT_TEMPLATE

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
BRACKETS = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"


def up_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def worker_config(argv: list[str]) -> WorkerServiceConfig:
    parser = argparse.ArgumentParser()
    WorkerServiceConfig.add_arguments(parser)
    return WorkerServiceConfig.from_args(parser.parse_args(argv), {})


ALIASES = [
    (["--model", "{model}"], "model_path", "{model}"),
    (["--tp", "2"], "tp_size", 2),
    (["--tensor-parallel-size", "2"], "tp_size", 2),
    (["--pp-size", "2"], "pp_size", 2),
    (["--pipeline-parallel-size", "2"], "pp_size", 2),
    (["--max-model-len", "64"], "context_length", 64),
    (["--chunked-prefill-size", "-1"], "chunked_prefill_size", None),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float"], "dtype", "float32"),
]


@pytest.mark.parametrize(("argv", "field", "value"), ALIASES)
def test_aliases_on_up_and_on_the_worker_set_the_engine_setting(
    qwen3_path: Path, argv: list[str], field: str, value: object
) -> None:
    argv = [a.format(model=qwen3_path) for a in argv]
    value = value.format(model=qwen3_path) if isinstance(value, str) else value
    model = [] if "--model" in argv else ["--model-path", str(qwen3_path)]
    engine, env = model_settings(up_args([*model, *argv]))
    assert getattr(engine, field) == value
    assert env[flags.env_name(field)] == ("none" if value is None else str(value))
    assert getattr(worker_config([*model, *argv]).engine, field) == value
    # What `up` hands a worker in its environment builds the same engine there.
    assert getattr(WorkerServiceConfig.from_args(None, env).engine, field) == value


def test_the_tokenizer_service_takes_the_aliases_too() -> None:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, TokenizerConfig)
    config = flags.build(TokenizerConfig, parser.parse_args(["--model", "m", "--max-model-len", "64"]), {})
    assert (config.model_path, config.context_length) == ("m", 64)
    assert flags.build(TokenizerConfig, None, {"RS_MAX_MODEL_LEN": "32"}).context_length == 32


def test_two_spellings_with_different_values_are_refused(qwen3_path: Path) -> None:
    with pytest.raises(ValueError, match="--tp-size 1 and --tp 2 are two spellings of one setting"):
        model_settings(up_args(["--model-path", str(qwen3_path), "--tp-size", "1", "--tp", "2"]))
    with pytest.raises(ValueError, match="two spellings of one setting"):
        worker_config(["--model-path", str(qwen3_path), "--model", "other"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float8"}, "dtype must be one of auto, float32, bfloat16, float16, half, float"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size must be >= 1, or -1 or None"),
        ({"chunked_prefill_size": -2}, "chunked_prefill_size must be >= 1, or -1 or None"),
        ({"chat_template": "no-such-template.jinja"}, "neither a file nor a Jinja template"),
    ],
)
def test_bad_model_settings_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", **kwargs)


def test_up_refuses_a_bad_dtype_before_starting_anything(qwen3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_up(up_args(["--model-path", str(qwen3_path), "--dtype", "float8"])) == 2
    assert "dtype must be one of" in capsys.readouterr().err


def test_dtype_half_loads_and_generates_in_float16(qwen3_path: Path) -> None:
    with Engine(str(qwen3_path), dtype="half", max_total_tokens=128) as engine:
        assert engine.config.dtype == "float16"
        assert engine.model_config.dtype == torch.float16
        out = engine.generate("The capital of France is", GREEDY)
    assert len(out["output_ids"]) == 6


def test_a_separate_tokenizer_path_gives_the_same_answer(qwen3_path: Path, qwen3_sharded_path: Path) -> None:
    """qwen3_sharded_path holds qwen3_path's weights without a tokenizer."""
    with Engine(str(qwen3_path), max_total_tokens=128) as engine:
        expected = engine.generate("The capital of France is", GREEDY)
    with Engine(str(qwen3_sharded_path), tokenizer_path=str(qwen3_path), max_total_tokens=128) as engine:
        assert engine.tokenizer is not None
        assert engine.generate("The capital of France is", GREEDY)["output_ids"] == expected["output_ids"]
    prompts = PromptTokenizer.load(str(qwen3_sharded_path), tokenizer_path=str(qwen3_path))
    assert prompts.tokenizer.encode("hello world") == PromptTokenizer.load(str(qwen3_path)).tokenizer.encode("hello world")


def test_a_tokenizer_path_without_a_tokenizer_is_an_error(qwen3_path: Path, qwen3_sharded_path: Path) -> None:
    with pytest.raises(ValueError, match=f"tokenizer_path '{qwen3_sharded_path}' has no usable tokenizer"):
        Engine(str(qwen3_path), tokenizer_path=str(qwen3_sharded_path), max_total_tokens=128)


@pytest.mark.parametrize("as_file", [False, True])
def test_a_chat_template_replaces_the_checkpoint_s(qwen3_path: Path, tmp_path: Path, as_file: bool) -> None:
    template = BRACKETS
    if as_file:
        (tmp_path / "brackets.jinja").write_text(BRACKETS)
        template = str(tmp_path / "brackets.jinja")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with Engine(str(qwen3_path), chat_template=template, max_total_tokens=128) as engine:
        assert engine.apply_chat_template(messages) == "[system: be brief][user: hi]"
    prompts = PromptTokenizer.load(str(qwen3_path), chat_template=template)
    ids = prompts.chat_ids([ChatMessage(**m) for m in messages], True, None, None)
    assert prompts.tokenizer.decode(ids) == "[system: be brief][user: hi]"
    assert PromptTokenizer.load(str(qwen3_path)).tokenizer.chat_template == CHAT_TEMPLATE


def test_trust_remote_code_is_accepted_but_an_unknown_architecture_is_refused(qwen3_path: Path, tmp_path: Path) -> None:
    assert worker_config(["--model-path", str(qwen3_path), "--trust-remote-code"]).engine.trust_remote_code
    fancy = tmp_path / "fancy"
    shutil.copytree(qwen3_path, fancy)
    config = json.loads((fancy / "config.json").read_text())
    (fancy / "config.json").write_text(json.dumps({**config, "architectures": ["FancyForCausalLM"]}))
    refused = (r"\['FancyForCausalLM'\] are not implemented by radixserve.*"
               r"LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match=refused):
        Engine(str(fancy), trust_remote_code=True, max_total_tokens=128)
    with pytest.raises(ValueError, match=refused):
        worker_config(["--model-path", str(fancy), "--trust-remote-code"])


def test_up_refuses_an_unimplemented_architecture_before_starting_anything(
    qwen3_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fancy = tmp_path / "fancy"
    shutil.copytree(qwen3_path, fancy)
    config = json.loads((fancy / "config.json").read_text())
    (fancy / "config.json").write_text(json.dumps({**config, "architectures": ["FancyForCausalLM"]}))
    assert run_up(up_args(["--model", str(fancy), "--trust-remote-code", "--run-dir", str(tmp_path / "run")])) == 2
    assert "['FancyForCausalLM'] are not implemented by radixserve" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_up_passes_model_settings_to_every_child(qwen3_path: Path, qwen3_sharded_path: Path, tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(BRACKETS)
    _, env = model_settings(up_args([
        "--model", str(qwen3_sharded_path), "--tokenizer-path", str(qwen3_path), "--chat-template",
        str(tmp_path / "t.jinja"), "--served-model-name", "tiny", "--api-key", "k1,k2", "--log-level", "debug",
    ]))
    assert env["RS_MODEL_PATH"] == str(qwen3_sharded_path)
    assert (env["RS_TOKENIZER_PATH"], env["RS_CHAT_TEMPLATE"]) == (str(qwen3_path), str(tmp_path / "t.jinja"))
    assert (env["RS_SERVED_MODEL_NAME"], env["RS_API_KEY"], env["RS_LOG_LEVEL"]) == ("tiny", "k1,k2", "DEBUG")
    from services.gateway.config import GatewayConfig

    gateway = flags.build(GatewayConfig, None, env)
    assert (gateway.api_key, gateway.served_model_name, gateway.log_level) == ("k1,k2", "tiny", "DEBUG")
    assert (gateway.tokenizer_path, gateway.chat_template) == (str(qwen3_path), str(tmp_path / "t.jinja"))
    tokenizer = flags.build(TokenizerConfig, None, env)
    assert (tokenizer.tokenizer_path, tokenizer.chat_template, tokenizer.log_level) == (
        str(qwen3_path), str(tmp_path / "t.jinja"), "DEBUG")
    worker = WorkerServiceConfig.from_args(None, env)
    assert (worker.model_name, worker.engine.tokenizer_path, worker.log_level) == ("tiny", str(qwen3_path), "DEBUG")


def test_up_defaults_and_the_environment_it_reads(qwen3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RS_API_KEY", raising=False)
    monkeypatch.delenv("RS_LOG_LEVEL", raising=False)
    monkeypatch.delenv("RS_SERVED_MODEL_NAME", raising=False)
    _, env = model_settings(up_args(["--model-path", str(qwen3_path)]))
    assert (env["RS_SERVED_MODEL_NAME"], env["RS_LOG_LEVEL"]) == (qwen3_path.name, "INFO")
    assert "RS_API_KEY" not in env
    monkeypatch.setenv("RS_API_KEY", "from-env")
    monkeypatch.setenv("RS_LOG_LEVEL", "warning")
    monkeypatch.setenv("RS_SERVED_MODEL_NAME", "env-name")
    _, env = model_settings(up_args(["--model-path", str(qwen3_path)]))
    assert (env["RS_API_KEY"], env["RS_LOG_LEVEL"], env["RS_SERVED_MODEL_NAME"]) == ("from-env", "WARNING", "env-name")
    monkeypatch.setenv("RS_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="RS_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"):
        model_settings(up_args(["--model-path", str(qwen3_path)]))
