"""Rendering ops/helm/radixserve offline (helm-python-sdk: Helm's own SDK, no cluster) and reading the
objects it makes.

    objects = render_chart(values_set("gpu-tp2"))
    worker = find(objects, "StatefulSet", "worker")
    env = resolve_env(container, pod_name, secret_values)   # what the kubelet gives the container
    argv = [kubernetes_expand(a, env) for a in container["args"]]
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.services_helpers import REPO_ROOT

CHART = REPO_ROOT / "ops" / "helm" / "radixserve"
VALUE_SETS = REPO_ROOT / "tests" / "data" / "helm"
RELEASE, NAMESPACE = "rs", "serving"
FULLNAME = f"{RELEASE}-radixserve"


def values_set(name: str) -> dict[str, Any]:
    return yaml.safe_load((VALUE_SETS / f"{name}.yaml").read_text()) if name != "defaults" else {}


def render_chart(values: dict[str, Any], chart: Path = CHART) -> list[dict[str, Any]]:
    """Every object the chart renders for `values` (release rs, namespace serving)."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def find(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    """The object of `kind` named {fullname}-{component}."""
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == f"{FULLNAME}-{component}"]
    assert len(matches) == 1, f"{len(matches)} {kind} named {FULLNAME}-{component}"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every Deployment and StatefulSet, init ones too."""
    for workload in objects:
        if workload["kind"] in ("Deployment", "StatefulSet"):
            spec = pod_spec(workload)
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                yield workload, container


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env entries by name."""
    return {e["name"]: e for e in container.get("env", [])}


def resolve_env(container: dict[str, Any], pod_name: str, secret_values: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """A container's environment as the kubelet makes it: values as written, the pod's name for the
    metadata.name fieldRef, secretKeyRefs from `secret_values` ((Secret name, key) -> value; a missing
    one must be optional)."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[entry["name"]] = pod_name
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            if (ref["name"], ref["key"]) in secret_values:
                env[entry["name"]] = secret_values[(ref["name"], ref["key"])]
            else:
                assert ref.get("optional"), f"{entry['name']}: no Secret {ref['name']}/{ref['key']}"
    return env


_REFERENCE = re.compile(r"\$(\$|\(([^)]*)\))")


def kubernetes_expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: $(NAME) becomes NAME's value when the
    container's env has it (left as written when not), $$ a literal $, in one pass (a value is not
    expanded again)."""

    def one(match: re.Match[str]) -> str:
        if match.group(1) == "$":
            return "$"
        return env.get(match.group(2), match.group(0))

    return _REFERENCE.sub(one, text)
