"""docker-compose.yml is a valid compose file (`docker-compose config -q` where the binary exists, the
compose-spec JSON schema always) and says what the deployment needs: NATS with auth and 8 MB messages,
the same login for every service, health checks and healthy dependencies, scalable services, GPU
workers behind a profile, the models volume where the images look for models, and provisioned
monitoring, and RS_ALLOWED_ORIGINS passed to the gateway (CORS, off unless set: a gateway given the
file's environment answers preflights of those origins only). Whether its commands and variables
really run is tests/test_deploy_wiring.py's subject.
tests/data/compose_spec.json is the compose-spec schema as docker-compose 1.29 ships it (Apache-2.0)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from shared.natsd import NatsServer
from tests.cors_helpers import allows, deployed_gateway, preflight, refuses
from tests.deploy_helpers import (
    COMPOSE_FILE,
    COMPOSE_SERVICES,
    compose_environment,
    dockerfile_stages,
    flag_value,
    interpolate,
    load_compose,
)
from tests.services_helpers import REPO_ROOT

ENV = {"RS_NATS_PASSWORD": "compose-test-password", "RS_API_KEY": "compose-test-key"}
APP, OTHER = "https://app.example.com", "https://evil.example.net"
SCALED = ("gateway", "tokenizer", "worker")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(ENV)


def compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def test_docker_compose_accepts_the_file() -> None:
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker-compose or `docker compose` here (`apt-get install docker-compose`); "
                    "test_the_file_matches_the_compose_spec_schema still checks the file")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RS_")}
    for profile in ([], ["--profile", "gpu"]):
        done = subprocess.run([*binary, "-f", str(COMPOSE_FILE), *profile, "config", "-q"], cwd=REPO_ROOT,
                              env={**env, **ENV}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    # The NATS password is required: without it compose refuses to start anything.
    done = subprocess.run([*binary, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO_ROOT,
                          env={**env, "RS_API_KEY": "k"}, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "RS_NATS_PASSWORD" in done.stderr


def test_the_file_matches_the_compose_spec_schema() -> None:
    schema = json.loads((REPO_ROOT / "tests" / "data" / "compose_spec.json").read_text())
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    validator.validate(raw)
    broken = copy.deepcopy(raw)
    broken["services"]["gateway"]["depends_on"]["nats"]["condition"] = "service_up"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


def test_required_variables_are_refused_when_unset() -> None:
    with pytest.raises(ValueError, match="RS_NATS_PASSWORD"):
        load_compose({"RS_API_KEY": "k"})
    assert interpolate("${A:-x} ${B-y} $$C ${D}", {"B": ""}) == "x  $C "


def test_values_are_substituted_after_parsing_as_compose_does() -> None:
    """A value stays the string it is, whatever YAML would make of it in the file's text."""
    for password in ("12345", "true", 'q"u#o: te', "${RS_API_KEY}"):
        services = load_compose({**ENV, "RS_NATS_PASSWORD": password})["services"]
        assert flag_value(services["nats"]["command"], "--pass") == password
        assert compose_environment(services["gateway"])["RS_NATS_PASSWORD"] == password


def test_nats_has_auth_8mb_messages_and_monitoring(compose: dict[str, Any]) -> None:
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:")
    config_mount = next(v for v in nats["volumes"] if v.endswith(":/etc/nats/nats.conf:ro"))
    conf = (REPO_ROOT / config_mount.split(":")[0]).read_text()
    assert "max_payload: 8MB" in conf and "http_port: 8222" in conf
    # The login is the server's flags, not `$VAR` references in the file: nats-server parses a reference's
    # value as config syntax (tests/test_nats_login.py starts it with passwords that break that).
    settings = [line for line in conf.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in settings if "$" in line or "authorization" in line], settings
    assert (flag_value(nats["command"], "--user"), flag_value(nats["command"], "--pass")) == ("radixserve", ENV["RS_NATS_PASSWORD"])
    assert "8222/healthz" in " ".join(nats["healthcheck"]["test"])


@pytest.mark.parametrize("name", [*COMPOSE_SERVICES, "worker-gpu"])
def test_every_service_logs_in_to_nats_with_the_deployment_login(compose: dict[str, Any], name: str) -> None:
    env = compose_environment(compose["services"][name])
    nats_argv = compose["services"]["nats"]["command"]
    assert env["RS_NATS_URL"] == "nats://nats:4222"
    assert (env["RS_NATS_USER"], env["RS_NATS_PASSWORD"]) == (flag_value(nats_argv, "--user"), flag_value(nats_argv, "--pass"))


def test_every_service_is_health_checked_and_waits_for_healthy_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        if name == "model":  # a one-shot job: the others wait for it to complete
            assert service["restart"] == "no" and service["healthcheck"] == {"disable": True}
            continue
        assert service["healthcheck"]["test"][0] == "CMD", name
        for dependency, condition in (service.get("depends_on") or {}).items():
            expected = "service_completed_successfully" if dependency == "model" else "service_healthy"
            assert condition == {"condition": expected}, (name, dependency)
            assert dependency in services
    for name in [*COMPOSE_SERVICES, "worker-gpu"]:
        assert services[name]["healthcheck"]["test"] == ["CMD", "radixserve", "probe"]


def test_the_scaled_services_have_no_fixed_names_or_host_ports(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "container_name" not in service, name
    for name in SCALED:
        assert "ports" not in compose["services"][name], name
    # The published HTTP and gRPC ports belong to the load balancer in front of the gateways.
    lb = compose["services"]["lb"]
    assert lb["ports"] == ["8000:8000", "50051:50051"]
    nginx = (REPO_ROOT / "ops" / "nginx" / "nginx.conf").read_text()
    gateway_env = compose_environment(compose["services"]["gateway"])
    assert f"http://gateway:{gateway_env['RS_PORT']}" in nginx and f"grpc://gateway:{gateway_env['RS_GRPC_PORT']}" in nginx
    assert "resolver 127.0.0.11" in nginx  # re-resolved, so new replicas join


def test_allowed_origins_reach_the_gateway_and_only_they_pass_a_preflight(nats: NatsServer) -> None:
    default = compose_environment(load_compose(ENV)["services"]["gateway"])
    assert default["RS_ALLOWED_ORIGINS"] == ""  # unset: CORS off
    origins = f"{APP},http://localhost:3000"
    env = compose_environment(load_compose({**ENV, "RS_ALLOWED_ORIGINS": origins})["services"]["gateway"])
    assert env["RS_ALLOWED_ORIGINS"] == origins
    with deployed_gateway(nats.url, env) as gateway:
        assert allows(preflight(gateway.url, APP), APP)
        assert refuses(preflight(gateway.url, OTHER))
    with deployed_gateway(nats.url, default) as gateway:
        assert refuses(preflight(gateway.url, APP))


def test_gpu_workers_are_a_profile_reserving_nvidia_devices(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and "profiles" not in services["worker"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert compose_environment(gpu)["RS_DEVICE"] == "cuda" and compose_environment(services["worker"])["RS_DEVICE"] == "cpu"
    assert gpu["networks"]["default"]["aliases"] == ["worker"]  # scraped under the worker job


def test_images_are_the_dockerfile_targets_and_models_sit_on_a_named_volume(compose: dict[str, Any]) -> None:
    stages = dockerfile_stages(REPO_ROOT / "Dockerfile")
    targets = {"tokenizer": "edge", "detokenizer": "edge", "gateway": "edge", "worker": "cpu", "worker-gpu": "cuda",
               "model": "cpu"}
    for name, target in targets.items():
        service = compose["services"][name]
        assert service["build"]["target"] == target and target in stages
        assert "models:/models" in service["volumes"]
        assert stages[target].env()["RS_HOME"] == "/models"
    assert "models" in compose["volumes"]
    assert compose["services"]["model"]["command"] == ["model", "fetch"]


def test_prometheus_and_grafana_are_provisioned(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "./ops/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]["volumes"]
    assert "./ops/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana
    dashboards = yaml.safe_load((REPO_ROOT / "ops/grafana/provisioning/dashboards/radixserve.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    assert f"./ops/grafana/radixserve.json:{path}/radixserve.json:ro" in grafana
    datasources = yaml.safe_load((REPO_ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads((REPO_ROOT / "ops/grafana/radixserve.json").read_text())
    assert {p["datasource"]["type"] for p in dashboard["panels"]} == {"prometheus"}


def test_nginx_accepts_the_load_balancer_config(tmp_path: Path) -> None:
    if shutil.which("nginx") is None:
        pytest.skip("no nginx here (`apt-get install nginx-light`); the facts about its config are checked above")
    (tmp_path / "logs").mkdir()
    conf = REPO_ROOT / "ops" / "nginx" / "nginx.conf"
    done = subprocess.run(["nginx", "-t", "-c", str(conf), "-p", str(tmp_path), "-e", "stderr"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken.conf"
    broken.write_text(conf.read_text().replace("proxy_buffering off;", "proxy_buffering of;"))
    done = subprocess.run(["nginx", "-t", "-c", str(broken), "-p", str(tmp_path), "-e", "stderr"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "proxy_buffering" in done.stderr
