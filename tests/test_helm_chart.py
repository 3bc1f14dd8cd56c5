"""ops/helm/radixserve, rendered offline by Helm's SDK for the default values and three sets (CPU demo,
one GPU worker with tp=2, scaled out with an Ingress and API keys): Helm's lint finds no error, every
object is valid against Kubernetes' schemas, and the objects say what the deployment needs (GPU
requests, env that the services read, probes, secrets referenced and never inlined, the gateway alone
open to the outside, gateway.allowedOrigins in the gateway's RS_ALLOWED_ORIGINS: a gateway given its
environment answers preflights of those origins only)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from shared.natsd import NatsServer
from tests.cors_helpers import allows, deployed_gateway, preflight, refuses
from tests.deploy_helpers import flag_value
from tests.helm_helpers import (
    CHART,
    FULLNAME,
    container,
    containers,
    env_of,
    find,
    pod_spec,
    render_chart,
    values_set,
)
from tests.wiring_helpers import env_names

SETS = ("defaults", "cpu-demo", "gpu-tp2", "scaled")
KUBERNETES = "1.37.0"
SUBCOMMANDS = {"gateway", "tokenizer", "worker", "detokenizer"}
APP, OTHER = "https://app.example.com", "https://evil.example.net"


@pytest.fixture(scope="module", params=SETS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_chart(values_set(request.param))


def test_helm_lint_finds_no_error() -> None:
    for name in SETS:
        report = helm.lint(str(CHART), values_set(name), strict=True, kube_version=f"v{KUBERNETES}")
        assert report["errors"] == [], (name, report)
        assert not [m for m in report["messages"] if m["severity"] >= 2], (name, report["messages"])


def test_every_object_is_valid_kubernetes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: its fields are checked in test_the_service_monitor_needs_the_operator
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    # And the check can fail.
    broken = find(objects, "Deployment", "gateway")
    broken = {**broken, "spec": {**broken["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_every_container_runs_a_radixserve_command_with_its_own_settings(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    seen = set()
    for workload, c in containers(objects):
        if not c["image"].strip('"').startswith("radixserve:"):
            continue
        subcommand = c["args"][0]
        if subcommand == "model":
            assert c["args"] == ["model", "fetch"] and env_of(c)["RS_HOME"]["value"] == "/models"
            continue
        assert subcommand in SUBCOMMANDS, c["args"]
        seen.add(subcommand)
        unknown = set(env_of(c)) - env_names(subcommand)
        assert not unknown, f"{workload['metadata']['name']}/{c['name']}: not settings of {subcommand}: {unknown}"
        # The port settings are the container's ports.
        env = env_of(c)
        ports = {p["containerPort"] for p in c["ports"]}
        opened = {int(env[n]["value"]) for n in ("RS_PORT", "RS_GRPC_PORT", "RS_METRICS_PORT") if n in env}
        assert opened == ports, (c["name"], opened, ports)
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
    assert seen == SUBCOMMANDS


def test_secrets_are_referenced_never_inlined(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    for _, c in containers(objects):
        env = env_of(c)
        for secret in ("RS_NATS_PASSWORD", "RS_API_KEY", "RS_ADMIN_API_KEY", "NATS_PASSWORD"):
            if secret in env:
                assert "value" not in env[secret] and "secretKeyRef" in env[secret]["valueFrom"], (c["name"], secret)
    gateway = env_of(container(find(objects, "Deployment", "gateway"), "gateway"))
    nats_secret = gateway["RS_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    if name == "scaled":
        assert nats_secret == {"name": "radixserve-nats", "key": "password"}
        assert gateway["RS_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "radixserve-api-keys", "key": "api-key"}
        assert not [o for o in objects if o["kind"] == "Secret"]  # the user's Secrets, not the chart's
    else:
        assert nats_secret["name"] == f"{FULLNAME}-nats"
        secret = find(objects, "Secret", "nats")
        assert len(secret["data"]["password"]) >= 40  # 32 random characters, base64
        conf = find(objects, "ConfigMap", "nats")["data"]["nats.conf"]
        assert "max_payload: 8MB" in conf
        # The login is the NATS container's flags, which Kubernetes fills in from its env (the Secret), not
        # `$VAR` references in nats.conf: nats-server parses a reference's value as config syntax
        # (tests/test_nats_login.py starts it with passwords that break that).
        settings = [line for line in conf.splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in settings if "$" in line or "authorization" in line], settings
        nats = container(find(objects, "StatefulSet", "nats"), "nats")
        assert (flag_value(nats["args"], "--user"), flag_value(nats["args"], "--pass")) == ("$(RS_NATS_USER)", "$(RS_NATS_PASSWORD)")
        assert env_of(nats)["RS_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == nats_secret


def test_gpu_workers_request_one_gpu_per_tensor_parallel_rank() -> None:
    objects = render_chart(values_set("gpu-tp2"))
    worker = container(find(objects, "StatefulSet", "worker"), "worker")
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 2 == worker["resources"]["limits"]["nvidia.com/gpu"]
    env = env_of(worker)
    assert (env["RS_TP_SIZE"]["value"], env["RS_DEVICE"]["value"], env["RS_DTYPE"]["value"]) == ("2", "cuda", "bfloat16")
    assert env["RS_MODEL_PATH"]["value"] == "/models/Qwen3-8B"
    assert worker["image"] == "radixserve:cuda"
    volumes = {v["name"]: v for v in pod_spec(find(objects, "StatefulSet", "worker"))["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    # The CPU demo asks for none.
    cpu = container(find(render_chart(values_set("cpu-demo")), "StatefulSet", "worker"), "worker")
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"] and env_of(cpu)["RS_DEVICE"]["value"] == "cpu"


def test_probes_readiness_follows_the_workers_and_grace_covers_the_drain(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    gateway_pod = find(objects, "Deployment", "gateway")
    gateway = container(gateway_pod, "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["startupProbe"]["grpc"]["port"] == int(env_of(gateway)["RS_GRPC_PORT"]["value"])
    worker_pod = find(objects, "StatefulSet", "worker")
    worker = container(worker_pod, "worker")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    for pod, c in ((gateway_pod, gateway), (worker_pod, worker)):
        drain = float(env_of(c)["RS_DRAIN_TIMEOUT"]["value"])
        assert pod_spec(pod)["terminationGracePeriodSeconds"] > drain
    # The worker id is the pod's stable name, shared by its detokenizer.
    detok = container(worker_pod, "detokenizer")
    for c in (worker, detok):
        assert env_of(c)["RS_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_only_the_gateway_is_open_and_only_services_reach_nats_and_redis() -> None:
    objects = render_chart({})
    policies = {o["metadata"]["name"].removeprefix(f"{FULLNAME}-"): o for o in objects if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"gateway", "tokenizer", "worker", "nats", "redis"}
    for name, policy in policies.items():
        rules = policy["spec"]["ingress"]
        if name == "gateway":
            assert all("from" not in r for r in rules)
        else:
            assert all(r.get("from") for r in rules), name
    nats_clients = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in policies["nats"]["spec"]["ingress"][0]["from"]}
    assert nats_clients == {"gateway", "tokenizer", "worker"}
    redis_clients = policies["redis"]["spec"]["ingress"][0]["from"]
    assert redis_clients == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway", "app.kubernetes.io/instance": "rs"}}}]
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["spec"].get("type", "ClusterIP") for s in services} == {"ClusterIP"}


def test_scaling_objects_ingress_and_disruption_budgets() -> None:
    objects = render_chart(values_set("scaled"))
    hpas = {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {f"{FULLNAME}-gateway", f"{FULLNAME}-tokenizer"}
    assert (hpas[f"{FULLNAME}-gateway"]["minReplicas"], hpas[f"{FULLNAME}-gateway"]["maxReplicas"]) == (3, 20)
    assert "replicas" not in find(objects, "Deployment", "gateway")["spec"]  # the HPA owns it
    assert find(objects, "StatefulSet", "worker")["spec"]["replicas"] == 4
    claim = find(objects, "StatefulSet", "worker")["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    ingress = find(objects, "Ingress", "gateway")["spec"]
    assert ingress["rules"][0]["host"] == "llm.example.com"
    assert ingress["rules"][0]["http"]["paths"][0]["backend"]["service"] == {"name": f"{FULLNAME}-gateway", "port": {"name": "http"}}
    pdbs = {o["metadata"]["name"].removeprefix(f"{FULLNAME}-") for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"gateway", "tokenizer", "worker"}  # NATS is external here
    assert "RS_REDIS_URL" not in env_of(container(find(objects, "Deployment", "gateway"), "gateway"))
    assert env_of(container(find(objects, "Deployment", "gateway"), "gateway"))["RS_NATS_URL"]["value"] == "nats://nats.messaging.svc:4222"


def test_the_service_monitor_needs_the_operator() -> None:
    assert not [o for o in render_chart({}) if o["kind"] == "ServiceMonitor"]  # no CRD offline: auto is off
    (monitor,) = [o for o in render_chart(values_set("scaled")) if o["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "metrics", "detok-metrics"]
    port_names = {p["name"] for o in render_chart({}) if o["kind"] == "Service" and "radixserve" in o["metadata"]["name"]
                  for p in o["spec"]["ports"]}
    assert {"http", "metrics", "detok-metrics"} <= port_names


def test_selectors_ports_and_references_point_at_what_the_chart_makes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """What the API server cannot check: a Service, PDB or NetworkPolicy that selects no pod, a named
    port no container has, a ConfigMap that does not exist."""
    _, objects = rendered
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]

    def pods(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]

    for obj in objects:
        if obj["kind"] == "Service":
            selected = pods(obj["spec"]["selector"])
            assert selected, obj["metadata"]["name"]
            names = {p["name"] for w in selected for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
            for port in obj["spec"]["ports"]:
                assert port["targetPort"] in names, (obj["metadata"]["name"], port)
        elif obj["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            key = "selector" if obj["kind"] == "PodDisruptionBudget" else "podSelector"
            assert pods(obj["spec"][key]["matchLabels"]), obj["metadata"]["name"]
    for workload in workloads:
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        spec = pod_spec(workload)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            port_names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                assert port is None or port in port_names, (c["name"], probe, port)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | claims, c["name"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]]


def test_each_disruption_budget_sets_one_bound(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert budgets
    for pdb in budgets:
        assert len({"minAvailable", "maxUnavailable"} & set(pdb["spec"])) == 1, pdb["spec"]


def gateway_env(values: dict[str, Any]) -> dict[str, str]:
    """The gateway container's environment as the chart renders it for `values` (secrets left out)."""
    env = env_of(container(find(render_chart(values), "Deployment", "gateway"), "gateway"))
    return {name: entry["value"] for name, entry in env.items() if "value" in entry}


def test_allowed_origins_reach_the_gateway_and_only_they_pass_a_preflight(nats: NatsServer) -> None:
    assert "RS_ALLOWED_ORIGINS" not in gateway_env({})  # unset: CORS off
    assert gateway_env({"gateway": {"allowedOrigins": f"{APP},http://localhost:3000"}})["RS_ALLOWED_ORIGINS"] == (
        f"{APP},http://localhost:3000")
    env = gateway_env({"gateway": {"allowedOrigins": [APP, "http://localhost:3000"]}})
    assert env["RS_ALLOWED_ORIGINS"] == f"{APP},http://localhost:3000"
    with deployed_gateway(nats.url, env) as gateway:
        assert allows(preflight(gateway.url, APP), APP)
        assert refuses(preflight(gateway.url, OTHER))


def test_bad_values_are_refused_with_a_message() -> None:
    with pytest.raises(Exception, match="worker.model.source must be fetch, pvc or hostPath"):
        render_chart({"worker": {"model": {"source": "s3"}}})
    with pytest.raises(Exception, match="nats.url is needed"):
        render_chart({"nats": {"enabled": False}})
    with pytest.raises(Exception, match="gateway.pdb: give minAvailable or maxUnavailable, not both"):
        render_chart({"gateway": {"pdb": {"maxUnavailable": 1}}})
