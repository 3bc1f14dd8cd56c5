"""Service configs from the command line and RS_* variables: flag beats variable beats default, bad
values are ValueErrors naming the flag or variable, and the worker's command line carries the engine's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.detokenizer.config import DetokenizerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.frontend.service_config import WorkerServiceConfig
from shared import flags


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, cls)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_default() -> None:
    env = {"RS_NATS_URL": "nats://env:4222", "RS_QUEUE_GROUP": "from-env"}
    config = flags.build(TokenizerConfig, parse(TokenizerConfig, ["--nats-url", "nats://flag:4222"]), env)
    assert config.nats_url == "nats://flag:4222"
    assert config.queue_group == "from-env"
    assert config.subject_prefix == "rs" and config.metrics_port == 9401


def test_none_booleans_and_numbers_are_read_from_text() -> None:
    env = {"RS_METRICS_PORT": "none", "RS_SILENT_WORKER_TIMEOUT": "2.5"}
    config = flags.build(DetokenizerConfig, parse(DetokenizerConfig, ["--worker-id", "w7"]), env)
    assert (config.metrics_port, config.silent_worker_timeout, config.worker_id) == (None, 2.5, "w7")


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {"RS_METRICS_PORT": "many"}, "RS_METRICS_PORT"),
        ([], {"RS_DRAIN_TIMEOUT": "-1"}, "drain_timeout"),
        ([], {"RS_SUBJECT_PREFIX": "a b"}, "subject_prefix"),
        ([], {"RS_WORKER_ID": "w.1"}, "worker_id"),
    ],
)
def test_bad_values_name_the_setting(argv: list[str], env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        flags.build(DetokenizerConfig, parse(DetokenizerConfig, argv), env)


def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(TokenizerConfig, ["--metrics-port", "many"])
    assert "--metrics-port" in capsys.readouterr().err


def test_worker_command_line_builds_the_engine_config_too(qwen3_path: Path) -> None:
    parser = argparse.ArgumentParser()
    WorkerServiceConfig.add_arguments(parser)
    args = parser.parse_args(
        ["--model-path", str(qwen3_path), "--worker-id", "w1", "--with-detokenizer", "--chunked-prefill-size", "none"]
    )
    config = WorkerServiceConfig.from_args(args, {"RS_TP_SIZE": "2", "RS_MAX_TOTAL_TOKENS": "512"})
    assert (config.worker_id, config.with_detokenizer, config.model_name) == ("w1", True, qwen3_path.name)
    assert config.engine.model_path == str(qwen3_path)
    assert (config.engine.tp_size, config.engine.max_total_tokens, config.engine.chunked_prefill_size) == (2, 512, None)


def test_workers_get_distinct_random_ids_by_default(qwen3_path: Path) -> None:
    env = {"RS_MODEL_PATH": str(qwen3_path)}
    ids = {WorkerServiceConfig.from_args(None, env).worker_id for _ in range(3)}
    assert len(ids) == 3


def test_services_run_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvloop

    from shared.service import event_loop_factory

    monkeypatch.delenv("RS_EVENT_LOOP", raising=False)
    loop = event_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    monkeypatch.setenv("RS_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
    monkeypatch.setenv("RS_EVENT_LOOP", "tokio")
    with pytest.raises(ValueError, match="RS_EVENT_LOOP must be auto, asyncio or uvloop, got 'tokio'"):
        event_loop_factory()


def test_a_shared_gateway_port_must_be_fixed(qwen3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.config import GatewayConfig
    from services.launch import add_up_commands, run_up

    with pytest.raises(ValueError, match="reuse_port needs a fixed port"):
        flags.build(GatewayConfig, parse(GatewayConfig, ["--reuse-port", "--port", "0"]), {})
    assert flags.build(GatewayConfig, parse(GatewayConfig, ["--reuse-port", "--port", "8123"]), {}).reuse_port
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    model = ["--model-path", str(qwen3_path)]
    for argv in (["up", "--gateways", "0", *model], ["up", "--gateways", "2", "--port", "0", *model],
                 ["up", "--gateways", "many", *model]):
        assert run_up(parser.parse_args(argv)) == 2
        assert "--gateways must be auto or >= 1, and more than one needs a fixed --port" in capsys.readouterr().err


def test_local_tokenizer_max_chars_and_up_gateway_tokenizes(qwen3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.config import GatewayConfig
    from services.launch import add_up_commands

    built = flags.build(GatewayConfig, parse(GatewayConfig, ["--local-tokenizer-max-chars", "512"]), {})
    assert built.local_tokenizer_max_chars == 512
    assert flags.build(GatewayConfig, parse(GatewayConfig, []), {"RS_LOCAL_TOKENIZER_MAX_CHARS": "none"}).local_tokenizer_max_chars is None
    with pytest.raises(ValueError, match="local_tokenizer_max_chars must be >= 0, got -1"):
        flags.build(GatewayConfig, parse(GatewayConfig, ["--local-tokenizer-max-chars", "-1"]), {})
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    model = ["--model-path", str(qwen3_path)]
    assert parser.parse_args(["up", *model]).gateway_tokenizes == "short"
    assert parser.parse_args(["up", "--gateway-tokenizes", *model]).gateway_tokenizes == "all"
    assert parser.parse_args(["up", "--gateway-tokenizes", "none", *model]).gateway_tokenizes == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--gateway-tokenizes", "some", *model])
    assert "invalid choice: 'some'" in capsys.readouterr().err


def test_the_gateway_parses_http_with_httptools_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from services.gateway.config import GatewayConfig
    from services.gateway.service import http_impl

    assert http_impl(GatewayConfig().http) == "httptools"  # installed with the project
    assert http_impl(flags.build(GatewayConfig, parse(GatewayConfig, ["--http", "h11"]), {}).http) == "h11"
    assert flags.build(GatewayConfig, parse(GatewayConfig, []), {"RS_HTTP": "httptools"}).http == "httptools"
    with pytest.raises(ValueError, match="http must be one of auto, httptools, h11, got 'http2'"):
        flags.build(GatewayConfig, parse(GatewayConfig, ["--http", "http2"]), {})
    # Where httptools does not import, auto falls back to h11.
    real_import = builtins.__import__

    def without_httptools(name: str, *args: object, **kwargs: object) -> object:
        if name == "httptools":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", without_httptools)
    assert http_impl("auto") == "h11"


# ---- namespace and NATS credentials (shared/nats_connection.py) -------------------------------------


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--namespace", "blue"], {}),
        (["--subject-prefix", "blue"], {}),
        ([], {"RS_NAMESPACE": "blue"}),
        ([], {"RS_SUBJECT_PREFIX": "blue"}),
        (["--namespace", "blue", "--subject-prefix", "blue"], {}),
        (["--namespace", "blue"], {"RS_SUBJECT_PREFIX": "red"}),  # a flag beats a variable
    ],
)
def test_namespace_is_an_alias_of_subject_prefix(argv: list[str], env: dict[str, str]) -> None:
    for cls in (TokenizerConfig, DetokenizerConfig):
        assert flags.build(cls, parse(cls, argv), env).subject_prefix == "blue"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--namespace", "blue", "--subject-prefix", "red"], {},
         "--subject-prefix 'red' and --namespace 'blue' are two spellings of one setting"),
        ([], {"RS_NAMESPACE": "blue", "RS_SUBJECT_PREFIX": "red"},
         "RS_SUBJECT_PREFIX 'red' and RS_NAMESPACE 'blue' are two spellings of one setting"),
        (["--namespace", "a.*"], {}, r"subject_prefix \(--namespace\) must be dot-separated NATS tokens"),
    ],
)
def test_two_different_namespaces_or_a_bad_one_are_refused(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flags.build(TokenizerConfig, parse(TokenizerConfig, argv), env)


def test_nats_credentials_come_from_flags_or_variables(tmp_path: Path) -> None:
    creds = tmp_path / "svc.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    config = flags.build(TokenizerConfig, parse(TokenizerConfig, ["--nats-user", "tok"]), {"RS_NATS_PASSWORD": "s3cret"})
    assert config.connect_options()["user"] == "tok" and config.connect_options()["password"] == "s3cret"
    assert config.connect_options()["inbox_prefix"] == "rs._INBOX"
    from_creds = flags.build(TokenizerConfig, parse(TokenizerConfig, []), {"RS_NATS_CREDS": str(creds)})
    assert from_creds.connect_options()["user_credentials"] == str(creds)


def test_a_nats_password_never_shows_in_a_config_repr() -> None:
    config = flags.build(TokenizerConfig, parse(TokenizerConfig, []), {"RS_NATS_USER": "tok", "RS_NATS_PASSWORD": "s3cret",
                                                                         "RS_NAMESPACE": "blue"})
    assert "s3cret" not in repr(config)
    assert config.nats_identity == "user 'tok'"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nats-user", "tok"], "--nats-user and --nats-password"),
        (["--nats-password", "pw"], "--nats-user and --nats-password"),
        (["--nats-token", "t", "--nats-user", "u", "--nats-password", "p"],
         "give one way to authenticate to NATS, not --nats-user and --nats-token"),
        (["--nats-creds", "/nonexistent/svc.creds"], r"--nats-creds \(RS_NATS_CREDS\): no such file: /nonexistent/svc.creds"),
        (["--nats-nkey-seed", "/nonexistent/u.nk"], r"--nats-nkey-seed \(RS_NATS_NKEY_SEED\): no such file"),
        (["--nats-tls-ca", "/nonexistent/ca.pem"], r"--nats-tls-ca \(RS_NATS_TLS_CA\): no such file"),
        (["--nats-tls-key", "/nonexistent/key.pem"], "--nats-tls-key needs --nats-tls-cert"),
    ],
)
def test_bad_nats_credentials_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        flags.build(TokenizerConfig, parse(TokenizerConfig, argv), {})


def test_a_service_with_bad_nats_credentials_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    assert main(["detokenizer", "--nats-creds", "/nonexistent/svc.creds"]) == 2
    assert "--nats-creds (RS_NATS_CREDS): no such file" in capsys.readouterr().err


def test_keys_cli_takes_the_namespace_under_either_name(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import main

    monkeypatch.setenv("RS_NAMESPACE", "blue")
    monkeypatch.setenv("RS_SUBJECT_PREFIX", "red")
    assert main(["keys", "--redis-url", "redis://127.0.0.1:1", "list"]) == 2
    assert "RS_SUBJECT_PREFIX 'red' and RS_NAMESPACE 'blue'" in capsys.readouterr().out


def test_up_refuses_bad_nats_options_before_starting_anything(qwen3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.launch import add_up_commands, run_up

    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    model = ["--model-path", str(qwen3_path)]
    for argv, message in (
        (["up", "--namespace", "a", "--subject-prefix", "b", *model], "two spellings of one setting"),
        (["up", "--nats-user", "u", *model], "--nats-user and --nats-password"),
    ):
        assert run_up(parser.parse_args(argv)) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://ops:s3cret@10.0.0.1:4222", "nats://ops:***@10.0.0.1:4222"),
        ("tls://t0ken@nats.internal:4222", "tls://***@nats.internal:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_credentials_in_a_nats_url_are_hidden_in_logs(url: str, shown: str) -> None:
    from shared.nats_connection import redact_url

    assert redact_url(url) == shown


def test_an_unreachable_nats_is_named_without_its_password() -> None:
    import asyncio

    from shared.service import ServiceConfig, connect_bus

    config = ServiceConfig(nats_url="nats://ops:s3cret@127.0.0.1:1", nats_connect_timeout=1)
    with pytest.raises(ConnectionError, match=r"NATS at nats://ops:\*\*\*@127.0.0.1:1 is unreachable") as caught:
        asyncio.run(connect_bus(config, "tokenizer"))
    assert "s3cret" not in str(caught.value)
