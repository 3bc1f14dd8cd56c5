"""A Hugging Face hub id as --model-path: a snapshot in the hub cache (HF_HOME), read offline when
HF_HUB_OFFLINE=1, the same model as its directory; a missing id is a clear error naming it, not a
traceback. The cache is laid out by the test exactly as huggingface_hub writes it."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest

from services.cli import main
from services.worker.frontend.engine import Engine
from services.worker.frontend.service_config import WorkerServiceConfig
from shared.model_path import resolve_model_path

REPO_ID = "TinyOrg/Tiny-Qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def place_in_hub_cache(checkpoint: Path, hf_home: Path, repo_id: str, commit: str) -> Path:
    """models--Org--Name/snapshots/<commit>/<files> with refs/main naming the commit (as huggingface_hub
    stores a download); returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture()
def hub_home(qwen3_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF_HOME whose hub cache holds the tiny Qwen3 checkpoint as REPO_ID at COMMIT."""
    place_in_hub_cache(qwen3_path, tmp_path / "hf", REPO_ID, COMMIT)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_home: Path) -> None:
    snapshot = hub_home / "hub" / "models--TinyOrg--Tiny-Qwen3" / "snapshots" / COMMIT
    assert resolve_model_path(REPO_ID) == snapshot
    assert resolve_model_path(REPO_ID, revision=COMMIT) == snapshot
    assert resolve_model_path(REPO_ID, revision="main") == snapshot


def test_an_engine_loaded_by_hub_id_answers_as_its_directory(hub_home: Path, qwen3_path: Path) -> None:
    with Engine(str(qwen3_path), max_total_tokens=256) as engine:
        direct = engine.generate(PROMPT, GREEDY)
    with Engine(REPO_ID, revision="main", max_total_tokens=256) as engine:
        assert Path(engine.config.model_path).parent.parent.name == "models--TinyOrg--Tiny-Qwen3"
        by_id = engine.generate(PROMPT, GREEDY)
    assert by_id["output_ids"] == direct["output_ids"] and len(direct["output_ids"]) == 8
    assert by_id["text"] == direct["text"]


def test_a_worker_serves_a_hub_model_under_its_id(hub_home: Path) -> None:
    parser = argparse.ArgumentParser()
    WorkerServiceConfig.add_arguments(parser)
    config = WorkerServiceConfig.from_args(parser.parse_args(["--model", REPO_ID]), {})
    assert config.model_name == REPO_ID
    assert config.engine.model_path.endswith(COMMIT)
    named = WorkerServiceConfig.from_args(parser.parse_args(["--model", REPO_ID, "--served-model-name", "q"]), {})
    assert named.model_name == "q"


def test_a_missing_hub_id_offline_is_an_error_naming_it(hub_home: Path) -> None:
    with pytest.raises(ValueError, match=r"'TinyOrg/Absent' is not a local directory.*is not in the hub cache .*HF_HUB_OFFLINE is set"):
        resolve_model_path("TinyOrg/Absent")
    with pytest.raises(ValueError, match=r"hub model TinyOrg/Tiny-Qwen3 at revision 'v2' is not in the hub cache .*HF_HUB_OFFLINE"):
        Engine(REPO_ID, revision="v2")


@pytest.mark.parametrize(
    ("command", "status"),
    [(["worker"], 2), (["up"], 2), (["chat", "hello"], 2), (["tokenizer"], 1), (["detokenizer"], 1)],
)
def test_the_cli_names_a_missing_hub_id_without_a_traceback(
    hub_home: Path, command: list[str], status: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 where the flags are checked before anything starts; the tokenizer and detokenizer load
    their tokenizer as they start, before they reach for NATS (here a port nothing listens on), and a
    service that cannot start exits 1, saying why."""
    monkeypatch.setenv("RS_NATS_URL", "nats://127.0.0.1:9")
    monkeypatch.setenv("RS_NATS_CONNECT_TIMEOUT", "2")
    assert main([*command, "--model-path", "TinyOrg/Absent"]) == status
    err = capsys.readouterr().err
    assert "model_path: 'TinyOrg/Absent' is not a local directory, and Hugging Face hub model TinyOrg/Absent" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("service", ["tokenizer", "detokenizer"])
def test_a_service_run_in_process_leaves_the_root_logger_as_it_found_it(
    hub_home: Path, service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The service logs to this test's captured stderr, which closes with the test: a handler on it left
    on the root logger made every later record (a gateway thread's in a later test, and at the end of
    the run) a 'Logging error ... I/O operation on closed file'."""
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    assert main([service, "--model-path", "TinyOrg/Absent"]) == 1
    assert (root.handlers, root.level) == before
    assert f"{service} failed to start" in capsys.readouterr().err


def test_a_draft_model_may_be_a_hub_id_too(hub_home: Path) -> None:
    from services.worker.config import EngineConfig

    config = EngineConfig.resolved(REPO_ID, speculative_algorithm="draft", speculative_draft_model_path=REPO_ID)
    assert config.speculative_draft_model_path == config.model_path == str(resolve_model_path(REPO_ID))
    assert config.model_path.endswith(COMMIT)


def test_chat_answers_with_a_hub_model(hub_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    argv = ["chat", "The capital of France is", "--model", REPO_ID, "--chat-template", template,
            "--max-new-tokens", "5", "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    with Engine(REPO_ID, device="cpu") as engine:
        expected = engine.generate("The capital of France is", {"max_new_tokens": 5, "temperature": 0.0})
    assert printed == expected["text"] + "\n"
