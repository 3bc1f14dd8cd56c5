"""The chart's rendered containers really run: NATS with the chart's own nats.conf and args and a
password from the user's Secret (one beginning `1e5`, which NATS's config parser would take for a
number), and every radixserve container with the args and env the chart gives it (secrets resolved
from the rendered Secret or the user's, the pod name for fieldRefs, the image's ENV under them), started
here as processes with the chart's Service addresses mapped to this machine's. A chat request goes
through the gateway, and every HTTP probe and Service metrics port the chart names answers."""

from __future__ import annotations

import base64
import json
import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.deploy_helpers import dockerfile_stages
from tests.helm_helpers import FULLNAME, containers, render_chart, resolve_env, values_set
from tests.keys_helpers import REDIS_URL
from tests.services_helpers import REPO_ROOT, ServiceProcess, free_port
from tests.wiring_helpers import (
    HostService,
    helm_nats,
    http_status,
    start_host_services,
    start_nats,
    wait_http,
)

pytestmark = pytest.mark.slow
KEYS_SECRET, NATS_SECRET = "rs-test-keys", "rs-test-nats"
ORDER = ("tokenizer", "detokenizer", "gateway", "worker")


@dataclass
class Pod:
    objects: list[dict[str, Any]]
    procs: dict[str, ServiceProcess]
    specs: dict[str, tuple[dict[str, Any], HostService]]  # container name -> (container, host spec)
    components: dict[str, str]  # container name -> its pod's component (app.kubernetes.io/name)
    addresses: dict[tuple[str, int], tuple[str, int]]
    api_key: str

    def port(self, container: str, port: int | str) -> int:
        raw = self.specs[container][0]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in raw["ports"] if p["name"] == port)
        return self.addresses[(container, port)][1]


@pytest.fixture(scope="module")
def pod(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    demo = values_set("cpu-demo")
    values = {**demo, "apiKeys": {"existingSecret": KEYS_SECRET}, "namespace": f"helm{secrets.token_hex(3)}",
              "nats": {**demo["nats"], "existingSecret": NATS_SECRET}}
    objects = render_chart(values)
    log_dir = tmp_path_factory.mktemp("helm")
    api_key = secrets.token_urlsafe(16)
    # A password nats-server's config parser would take for a number (1e5...): NATS gets it as a flag.
    secret_values = {(KEYS_SECRET, "api-key"): api_key, (NATS_SECRET, "password"): "1e5" + secrets.token_urlsafe(16)}
    for secret in (o for o in objects if o["kind"] == "Secret"):
        for key, value in secret["data"].items():
            secret_values[(secret["metadata"]["name"], key)] = base64.b64decode(value).decode()
    redis_host, redis_port = REDIS_URL.split("://", 1)[1].split("/")[0].split(":")
    nats_port, monitor_port, cluster_port = free_port(), free_port(), free_port()
    addresses = {(f"{FULLNAME}-nats", 4222): ("127.0.0.1", nats_port), (f"{FULLNAME}-redis", 6379): (redis_host, int(redis_port))}

    # NATS: the chart's config file and container, its volumes in a temporary directory.
    nats_argv, nats_env = helm_nats(objects, secret_values, f"{FULLNAME}-nats-0", log_dir, cluster_port)
    nats_proc = start_nats(nats_argv, nats_env, nats_port, monitor_port, log_dir / "nats.log")

    stages = dockerfile_stages(REPO_ROOT / "Dockerfile")
    specs: dict[str, tuple[dict[str, Any], HostService]] = {}
    components: dict[str, str] = {}
    image_envs = {}
    for workload, c in containers(objects):
        image = c["image"]
        if not image.startswith("radixserve:") or c["args"][0] == "model":
            continue
        pod_name = f"{workload['metadata']['name']}-0"
        tag = image.split(":", 1)[1]
        spec = HostService(c["name"], c["args"], resolve_env(c, pod_name, secret_values), edge=tag == "edge")
        for port in spec.opened_ports():
            addresses[(c["name"], port)] = ("127.0.0.1", free_port())
        specs[c["name"]] = (c, spec)
        components[c["name"]] = workload["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        image_envs[c["name"]] = stages[tag].env()
    assert set(specs) == set(ORDER)
    procs: dict[str, ServiceProcess] = {}
    try:
        assert wait_http(f"http://127.0.0.1:{monitor_port}/healthz") == 200, (log_dir / "nats.log").read_text()
        home = default_model_path.parents[1]
        ordered = [specs[name][1] for name in ORDER]
        procs = start_host_services(ordered[:3], addresses, image_envs, log_dir, home)
        result = Pod(objects, procs, specs, components, addresses, api_key)
        gateway = f"http://127.0.0.1:{result.port('gateway', 'http')}"
        assert http_status(f"{gateway}/health") == 200 and http_status(f"{gateway}/ready") == 503
        procs.update(start_host_services(ordered[3:], addresses, image_envs, log_dir, home))
        assert wait_http(f"{gateway}/ready", timeout=30) == 200
        yield result
    finally:
        for proc in reversed(list(procs.values())):
            proc.kill()
        nats_proc.kill()
        nats_proc.wait()


def test_a_chat_request_goes_through_the_charts_containers(pod: Pod) -> None:
    gateway = f"http://127.0.0.1:{pod.port('gateway', 'http')}"
    body = {"model": "any", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    headers = {"Authorization": f"Bearer {pod.api_key}", "Content-Type": "application/json"}
    models = json.loads(urllib.request.urlopen(urllib.request.Request(f"{gateway}/v1/models", headers=headers), timeout=10).read())
    body["model"] = models["data"][0]["id"]
    request = urllib.request.Request(f"{gateway}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert http_status(f"{gateway}/v1/models") == 401  # the key from the Secret is required


def test_every_probe_the_chart_names_answers(pod: Pod) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    checked = 0
    for name, (c, _) in pod.specs.items():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "httpGet" in probe:
                url = f"http://127.0.0.1:{pod.port(name, probe['httpGet']['port'])}{probe['httpGet']['path']}"
                assert http_status(url) == 200, (name, kind, url)
            else:
                with grpc.insecure_channel(f"127.0.0.1:{pod.port(name, probe['grpc']['port'])}") as channel:
                    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING, (name, kind)
            checked += 1
    assert checked >= 10


def test_every_service_port_the_monitor_scrapes_serves_metrics(pod: Pod) -> None:
    scraped = set()
    for service in (o for o in pod.objects if o["kind"] == "Service"):
        component = service["spec"]["selector"]["app.kubernetes.io/name"]
        for port in service["spec"]["ports"]:
            if port["name"] not in ("http", "metrics", "detok-metrics"):
                continue
            (container,) = [name for name, (c, _) in pod.specs.items() if pod.components[name] == component
                            and port["targetPort"] in {p["name"] for p in c["ports"]}]
            text = urllib.request.urlopen(f"http://127.0.0.1:{pod.port(container, port['targetPort'])}/metrics",
                                          timeout=10).read().decode()
            assert f"rs_{container}_" in text, container
            scraped.add(container)
    assert scraped == set(ORDER)
