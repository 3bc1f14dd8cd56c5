"""docker-compose.yml really runs: NATS with the file's own config and login (a password beginning
`1e5`, which NATS's config parser would take for a number), and every radixserve service with the
command and environment written there (the image's ENV under them), started here as real processes with
the compose addresses (`nats:4222`, `redis:6379`, each service's ports) mapped to this machine's. A chat
request goes through the gateway with the embedded model, each compose health check passes against its
process, every target ops/prometheus.yml names answers with its service's metrics, /ready follows the
worker, and SIGTERM drains each process to exit 0. A flag or RS_* name misspelt in the compose file
fails here."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import redis
import yaml

from services.probe import read_process
from tests.deploy_helpers import COMPOSE_SERVICES, compose_environment, dockerfile_stages, load_compose
from tests.keys_helpers import REDIS_URL
from tests.services_helpers import REPO_ROOT, ServiceProcess, free_port
from tests.wiring_helpers import (
    HostService,
    compose_nats,
    env_names,
    http_status,
    http_text,
    metric_total,
    probe,
    start_host_services,
    start_nats,
    wait_http,
)

pytestmark = pytest.mark.slow
ORDER = ("tokenizer", "detokenizer", "gateway", "worker")  # the worker last: /ready is 503 until it is up
# What each service's metrics show once one chat request went through.
COUNTED = {"gateway": "rs_gateway_requests_total", "tokenizer": "rs_tokenizer_prompt_tokens_total",
           "worker": "rs_worker_generated_tokens_total", "detokenizer": "rs_detokenizer_stream_messages_total"}


@dataclass
class Stack:
    compose: dict[str, Any]
    procs: dict[str, ServiceProcess]
    addresses: dict[tuple[str, int], tuple[str, int]]
    api_key: str
    nats_url: str

    def url(self, service: str, port: int) -> str:
        host, mapped = self.addresses[(service, port)]
        return f"http://{host}:{mapped}"

    @property
    def gateway(self) -> str:
        return self.url("gateway", int(compose_environment(self.compose["services"]["gateway"])["RS_PORT"]))


@pytest.fixture(scope="module")
def stack(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A password nats-server's config parser would take for a number (1e5...): NATS gets it as a flag.
    env = {"RS_NATS_PASSWORD": "1e5" + secrets.token_urlsafe(16), "RS_API_KEY": secrets.token_urlsafe(16),
           "RS_NAMESPACE": f"wire{secrets.token_hex(3)}"}
    compose = load_compose(env)
    services = compose["services"]
    log_dir = tmp_path_factory.mktemp("compose")
    stages = dockerfile_stages(REPO_ROOT / "Dockerfile")
    redis_host, redis_port = REDIS_URL.split("://", 1)[1].split("/")[0].split(":")
    addresses: dict[tuple[str, int], tuple[str, int]] = {("redis", 6379): (redis_host, int(redis_port))}

    nats_service = services["nats"]
    nats_port, monitor_port = free_port(), free_port()
    addresses[("nats", 4222)] = ("127.0.0.1", nats_port)
    addresses[("nats", 8222)] = ("127.0.0.1", monitor_port)
    nats_argv, nats_env = compose_nats(compose)
    nats_proc = start_nats(nats_argv, nats_env, nats_port, monitor_port, log_dir / "nats.log")
    specs = []
    for name in ORDER:
        service = services[name]
        assert service["command"][0] == COMPOSE_SERVICES[name]
        spec = HostService(name, service["command"], compose_environment(service), edge=service["build"]["target"] == "edge")
        for port in spec.opened_ports():
            addresses[(name, port)] = ("127.0.0.1", free_port())
        specs.append(spec)
    image_envs = {name: stages[services[name]["build"]["target"]].env() for name in ORDER}
    procs: dict[str, ServiceProcess] = {}
    try:
        healthz = nats_service["healthcheck"]["test"][-1].replace("127.0.0.1:8222", f"127.0.0.1:{monitor_port}")
        assert wait_http(healthz) == 200, (log_dir / "nats.log").read_text()
        home = default_model_path.parents[1]
        procs = start_host_services(specs[:3], addresses, image_envs, log_dir, home)
        stack = Stack(compose, procs, addresses, env["RS_API_KEY"], f"nats://127.0.0.1:{nats_port}")
        # Up without a worker: alive, not ready.
        assert http_status(f"{stack.gateway}/health") == 200 and http_status(f"{stack.gateway}/ready") == 503
        procs.update(start_host_services(specs[3:], addresses, image_envs, log_dir, home))
        assert wait_http(f"{stack.gateway}/ready", timeout=30) == 200
        yield stack
    finally:
        for proc in reversed(list(procs.values())):
            proc.kill()
        nats_proc.kill()
        nats_proc.wait()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"radixserve:{env['RS_NAMESPACE']}:*"):
            client.delete(key)


def test_every_variable_the_compose_file_sets_is_a_setting_of_its_service() -> None:
    compose = load_compose({"RS_NATS_PASSWORD": "p", "RS_API_KEY": "k"})
    for name, subcommand in COMPOSE_SERVICES.items():
        for service_name in (name, "worker-gpu") if name == "worker" else (name,):
            env = compose_environment(compose["services"][service_name])
            unknown = {k for k in env if k.startswith("RS_")} - env_names(subcommand)
            assert not unknown, f"{service_name}: not settings of `radixserve {subcommand}`: {sorted(unknown)}"
    # And the check can fail: a misspelling is not a setting.
    assert "RS_METRIC_PORT" not in env_names("tokenizer") and "RS_METRICS_PORT" in env_names("tokenizer")


def test_nats_refuses_a_client_without_the_login(stack: Stack) -> None:
    async def connect() -> None:
        nc = await nats.connect(stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
        await nc.close()

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(connect())


def test_a_chat_request_goes_through_the_compose_services(stack: Stack) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    models = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{stack.gateway}/v1/models", headers={"Authorization": f"Bearer {stack.api_key}"}), timeout=10).read())
    body["model"] = models["data"][0]["id"]
    request = urllib.request.Request(f"{stack.gateway}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert "Paris" in answer["choices"][0]["message"]["content"]
    # The key is required: the compose file's RS_API_KEY (and Redis) guard the gateway.
    assert http_status(f"{stack.gateway}/v1/models") == 401


def test_a_key_made_in_the_gateway_container_opens_the_gateway(stack: Stack) -> None:
    """`docker compose exec gateway radixserve keys create NAME`: with the gateway's own environment
    (its RS_REDIS_URL and namespace), the key lands where the gateway looks."""
    _, env = read_process(stack.procs["gateway"].proc.pid)
    done = subprocess.run([sys.executable, "-m", "services.cli", "keys", "create", "alice", "--rpm", "100"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip().splitlines()[-1]
    assert http_status(f"{stack.gateway}/v1/models", {"Authorization": f"Bearer {key}"}) == 200
    assert http_status(f"{stack.gateway}/v1/models", {"Authorization": f"Bearer {key}x"}) == 401


def test_each_compose_health_check_passes_against_its_process(stack: Stack) -> None:
    for name, proc in stack.procs.items():
        done = probe(stack.compose["services"][name]["healthcheck"]["test"], proc.proc.pid)
        assert done.returncode == 0, (name, done.stderr)
    ready = probe(stack.compose["services"]["gateway"]["healthcheck"]["test"], stack.procs["gateway"].proc.pid, "--ready")
    assert ready.returncode == 0, ready.stderr


def test_prometheus_scrapes_every_service_at_the_addresses_it_names(stack: Stack) -> None:
    config = yaml.safe_load((REPO_ROOT / "ops" / "prometheus.yml").read_text())
    scraped = set()
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                assert (name, sd["port"]) in stack.addresses, f"{job['job_name']}: nothing listens on {name}:{sd['port']}"
                text = http_text(stack.url(name, sd["port"]) + job.get("metrics_path", "/metrics"))
                assert metric_total(text, COUNTED[name]) > 0, (name, COUNTED[name])
                scraped.add(name)
    assert scraped == set(ORDER)


def test_sigterm_drains_every_service_to_exit_0(stack: Stack) -> None:
    worker = stack.procs["worker"]
    worker.proc.send_signal(15)
    # The gateway stops routing to a draining worker at once (its last load report says so).
    assert wait_http_not_ready(f"{stack.gateway}/ready", timeout=5)
    assert worker.terminate() == 0, worker.log()[-2000:]
    for name in ("gateway", "tokenizer", "detokenizer"):
        assert stack.procs[name].terminate() == 0, stack.procs[name].log()[-2000:]


def wait_http_not_ready(url: str, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http_status(url) == 503:
            return True
        time.sleep(0.05)
    return False


def test_the_compose_order_respects_its_dependencies() -> None:
    services = load_compose({"RS_NATS_PASSWORD": "p", "RS_API_KEY": "k"})["services"]
    for i, name in enumerate(ORDER):
        for dependency in services[name].get("depends_on", {}):
            assert dependency in ("nats", "redis", "model") or dependency in ORDER[:i], (name, dependency)
