"""The Dockerfile, read without a daemon: every final stage (cpu, the default; cuda; edge) runs
`radixserve <service>` as a non-root user with a health check, SIGTERM as its stop signal and the model
directory as a volume; the cpu and edge stages carry no compiler; the edge stage installs no torch and
its services run without it; and everything the build copies is in the build context."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from ops.docker.requirements import requirement_name, requirements
from tests.deploy_helpers import (
    Stage,
    dockerfile_stages,
    dockerignore_includes,
    dockerignore_rules,
    no_torch_pythonpath,
)
from tests.services_helpers import REPO_ROOT

FINAL_STAGES = ("edge", "cuda", "cpu")
SERVICES = ("gateway", "tokenizer", "worker", "detokenizer")
EDGE_SERVICES = ("gateway", "tokenizer", "detokenizer")
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|build-essential|cc|make|cmake|nvcc|cuda-toolkit\S*|cuda-nvcc\S*)\b")


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages(REPO_ROOT / "Dockerfile")


def radixserve(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_the_default_target_is_the_cpu_image(stages: dict[str, Stage]) -> None:
    assert list(stages)[-1] == "cpu"
    assert set(FINAL_STAGES) <= set(stages)


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_a_final_stage_runs_radixserve_as_a_non_root_user(stages: dict[str, Stage], name: str) -> None:
    stage = stages[name]
    user = stage.value("USER")
    assert user is not None and user.args not in ("root", "0", "0:0"), f"{name} runs as root"
    # The user exists: created in the stage's chain with a non-zero uid.
    created = " ".join(i.args for i in stage.all("RUN"))
    assert re.search(rf"useradd --uid \$\{{UID\}} .*\b{user.args}\b", created), created
    assert stages[name].value("ENTRYPOINT").words() == ["radixserve"]
    assert stage.value("CMD").words()[0] in SERVICES
    assert stage.value("STOPSIGNAL").args == "SIGTERM"
    health = stage.value("HEALTHCHECK")
    assert health is not None and health.args.split("CMD", 1)[1].strip() == '["radixserve", "probe"]'
    assert stage.value("VOLUME").words() == ["/models"]
    assert stage.env()["RS_HOME"] == "/models"
    # Servers listen on every interface inside a container (the defaults are loopback).
    assert stage.env()["RS_HOST"] == "0.0.0.0" and stage.env()["RS_METRICS_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("name", ["cpu", "edge"])
def test_cpu_and_edge_images_carry_no_compiler(stages: dict[str, Stage], name: str) -> None:
    stage = stages[name]
    assert stage.root_image().startswith("python:") and stage.root_image().endswith("-slim-bookworm")
    for run in stage.all("RUN"):
        assert not ("apt-get install" in run.args and COMPILERS.search(run.args)), run.args
    # Built things come from build stages: the final stage copies them, it does not build.
    copied_from = {i.args.split()[0].removeprefix("--from=") for i in stage.all("COPY") if i.args.startswith("--from=")}
    assert copied_from == {f"{name}-build"}
    # And the check can fail: the cuda stage installs gcc (Triton builds its launcher at run time).
    assert any(COMPILERS.search(r.args) for r in stages["cuda"].all("RUN"))


def test_the_edge_image_installs_the_dependencies_but_torch() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert requirements() == project["dependencies"]
    edge = requirements(edge=True)
    assert {requirement_name(r) for r in edge} == {requirement_name(r) for r in project["dependencies"]} - {"torch", "triton"}
    assert "flashinfer-python" in {requirement_name(r) for r in requirements(extras=("flashinfer",))}
    with pytest.raises(ValueError, match="no extra 'nope'"):
        requirements(extras=("nope",))


def test_the_edge_stage_installs_the_project_without_its_dependencies(stages: dict[str, Stage]) -> None:
    runs = " ".join(i.args for i in stages["edge-build"].all("RUN"))
    assert "requirements.py --edge" in runs and "pip install --no-deps -e ." in runs
    assert "torch" not in " ".join(i.args for i in stages["edge-build"].instructions)


@pytest.mark.parametrize("service", SERVICES)
def test_each_container_command_is_a_radixserve_subcommand(service: str) -> None:
    done = radixserve([service, "--help"])
    assert done.returncode == 0, done.stderr
    assert "--nats-url" in done.stdout and "RS_NATS_URL" in done.stdout


@pytest.mark.parametrize("service", EDGE_SERVICES)
def test_edge_commands_run_without_torch(service: str, tmp_path: Path) -> None:
    env = {"PYTHONPATH": no_torch_pythonpath(tmp_path)}
    assert radixserve(["probe", "--help"], env).returncode == 0
    done = radixserve([service, "--help"], env)
    assert done.returncode == 0, done.stderr
    # And the blocker works: the worker's engine cannot be imported under it.
    blocked = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **env}, capture_output=True, text=True)
    assert blocked.returncode == 1 and "ModuleNotFoundError" in blocked.stderr


def test_everything_the_build_copies_is_in_the_build_context(stages: dict[str, Stage]) -> None:
    rules = dockerignore_rules()
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.split()
    sources = {
        word for stage in stages.values() for copy in stage.instructions
        if copy.keyword == "COPY" and not copy.args.startswith("--from=") for word in copy.words()[:-1]
    }
    assert {"pyproject.toml", "services", "shared", "kernels", "proto"} <= sources
    for source in sources:
        files = [f for f in tracked if f == source or f.startswith(source.rstrip("/") + "/")]
        assert files, f"COPY {source}: no such file in the repository"
        assert all(dockerignore_includes(rules, f) for f in files), f"COPY {source}: excluded by .dockerignore"
    # Nothing else goes in: no tests, benchmarks, git history or local environments.
    for outside in ("tests/test_ops.py", "bench/report.py", ".git/HEAD", ".venv/bin/python", "Makefile"):
        assert not dockerignore_includes(rules, outside), outside
    assert not dockerignore_includes(rules, "services/__pycache__/cli.cpython-311.pyc")
