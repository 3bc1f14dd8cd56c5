"""Running a deployment's container specs as host processes: the command and environment a compose file
or a Helm chart gives each radixserve container, with its addresses (`nats:4222`, `redis:6379`, each
service's own ports) rewritten to this machine's, started as real `radixserve` processes.

    argv, env = compose_nats(load_compose(env))            # or helm_nats(objects, ...): the deployment's
    nats = start_nats(argv, env, port, monitor_port, log)  # own nats-server command, run here
    specs = [HostService("gateway", ["gateway"], env, edge=True), ...]
    procs = start_host_services(specs, address_map, log_dir, model_home)
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.probe import config_classes
from shared import flags
from shared.model_path import RS_HOME_ENV
from shared.natsd import nats_server_binary
from shared.service import die_with_parent
from tests.deploy_helpers import compose_environment, no_torch_pythonpath
from tests.helm_helpers import find, kubernetes_expand, resolve_env
from tests.services_helpers import REPO_ROOT, ServiceProcess

# Settings that open a port, and their flags.
PORT_SETTINGS = {"RS_PORT": "--port", "RS_GRPC_PORT": "--grpc-port", "RS_METRICS_PORT": "--metrics-port"}
_ADDRESS = re.compile(r"\b([A-Za-z][\w.-]*):(\d+)\b")


def env_names(service: str) -> set[str]:
    """Every RS_* variable `service` reads: one per flag spelling of its config classes."""
    names = {RS_HOME_ENV}  # where models live (shared/model_path.py), for every service
    for cls in config_classes(service):
        for f in dataclasses.fields(cls):
            if f.name != "engine":
                names |= {flags.env_name(s) for s in (f.name, *f.metadata.get("aliases", ()))}
    return names


@dataclass
class HostService:
    """One container as the deployment describes it: its `radixserve` argv and environment."""

    name: str  # the compose service / the chart's component: also its host name in the network
    argv: list[str]  # [subcommand, *args], what follows the `radixserve` entrypoint
    env: dict[str, str]
    edge: bool = False  # the edge image: torch cannot be imported
    ports: dict[int, int] = field(default_factory=dict)  # container port -> host port

    def opened_ports(self) -> list[int]:
        """The ports this container's settings open (from RS_PORT/RS_GRPC_PORT/RS_METRICS_PORT or their flags)."""
        found = [int(self.env[name]) for name in PORT_SETTINGS if self.env.get(name, "").isdigit()]
        for flag in PORT_SETTINGS.values():
            if flag in self.argv:
                found.append(int(self.argv[self.argv.index(flag) + 1]))
        return found


def rewrite(text: str, addresses: Mapping[tuple[str, int], tuple[str, int]]) -> str:
    """`text` with every host:port that `addresses` maps replaced by this machine's."""

    def one(match: re.Match[str]) -> str:
        key = (match.group(1), int(match.group(2)))
        if key not in addresses:
            return match.group(0)
        host, port = addresses[key]
        return f"{host}:{port}"

    return _ADDRESS.sub(one, text)


def host_argv_env(spec: HostService, addresses: Mapping[tuple[str, int], tuple[str, int]],
                  image_env: Mapping[str, str], model_home: Path) -> tuple[list[str], dict[str, str]]:
    """The argv and environment to run `spec` here: ports and addresses rewritten, the image's RS_HOME
    pointed at `model_home`, servers bound to loopback."""
    mine = {port: addresses[(spec.name, port)][1] for port in spec.opened_ports()}
    argv = [rewrite(a, addresses) for a in spec.argv]
    for flag in PORT_SETTINGS.values():
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(mine[int(argv[i])])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RS_")}
    env.update({k: v for k, v in image_env.items() if k.startswith("RS_")})
    env.update({k: rewrite(v, addresses) for k, v in spec.env.items()})
    for name in PORT_SETTINGS:
        if env.get(name, "").isdigit():
            env[name] = str(mine[int(env[name])])
    env["RS_HOME"] = str(model_home)
    for name in ("RS_HOST", "RS_METRICS_HOST"):
        if name in env:
            env[name] = "127.0.0.1"
    return argv, env


def start_host_services(specs: list[HostService], addresses: Mapping[tuple[str, int], tuple[str, int]],
                        image_envs: Mapping[str, Mapping[str, str]], log_dir: Path, model_home: Path,
                        ) -> dict[str, ServiceProcess]:
    """Start each spec (edge ones with torch unimportable) and wait until each says it is ready."""
    no_torch = no_torch_pythonpath(log_dir / "no-torch")
    started: dict[str, ServiceProcess] = {}
    for spec in specs:
        argv, env = host_argv_env(spec, addresses, image_envs[spec.name], model_home)
        if spec.edge:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [no_torch, env.get("PYTHONPATH")]))
        started[spec.name] = ServiceProcess.start(argv[0], argv[1:], log_dir, label=spec.name, env=env)
    try:
        for proc in started.values():
            proc.wait_ready()
    except BaseException:
        for proc in started.values():
            proc.kill()
        raise
    return started


def start_nats(argv: list[str], env: Mapping[str, str], port: int, monitor_port: int, log: Path) -> subprocess.Popen[bytes]:
    """The deployment's nats-server command on this machine: its config file and options as written, on
    loopback and the given ports (command-line flags override the file's)."""
    cmd = [str(nats_server_binary()), *argv, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor_port)]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, cwd=tempfile.gettempdir())


def compose_nats(compose: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """docker-compose.yml's nats service (loaded, so its variables are substituted) as nats-server's argv
    and environment here: its `command` as written, the mounted config file at its path in this checkout."""
    service = compose["services"]["nats"]
    mounts = {v.split(":")[1]: REPO_ROOT / v.split(":")[0] for v in service["volumes"]}
    return [str(mounts.get(a, a)) for a in service["command"]], compose_environment(service)


def helm_nats(objects: list[dict[str, Any]], secret_values: Mapping[tuple[str, str], str], pod_name: str,
              directory: Path, cluster_port: int) -> tuple[list[str], dict[str, str]]:
    """The rendered chart's NATS container as nats-server's argv and environment here: its ConfigMap's
    nats.conf written under `directory` (the pid file's volume there too), its env as the kubelet gives
    it (`resolve_env`), its args with $(NAME) expanded as Kubernetes does, routes listened for on
    loopback's `cluster_port`."""
    (container,) = find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    conf_dir, run_dir = directory / "nats-config", directory / "nats-run"
    conf_dir.mkdir(parents=True)
    run_dir.mkdir()
    conf = find(objects, "ConfigMap", "nats")["data"]["nats.conf"].replace("/var/run/nats", str(run_dir))
    (conf_dir / "nats.conf").write_text(conf)
    env = resolve_env(container, pod_name, secret_values)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    # The mount path as written in the args, then the values Kubernetes puts in.
    argv = [kubernetes_expand(a.replace(mount, str(conf_dir)), env) for a in container["args"]]
    return [*argv, "--cluster", f"nats://127.0.0.1:{cluster_port}"], env


def wait_http(url: str, timeout: float = 30.0) -> int:
    """Poll `url` until it answers 200 (returns 200), or the last status seen (0: unreachable) at the timeout."""
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline:
        status = http_status(url)
        if status == 200:
            return status
        time.sleep(0.2)
    return status


def http_status(url: str, headers: Mapping[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def probe(healthcheck: list[str], pid: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """A container health check (`["CMD", "radixserve", "probe", ...]`) run here against process `pid`."""
    assert healthcheck[:3] == ["CMD", "radixserve", "probe"], healthcheck
    cmd = [sys.executable, "-m", "services.cli", *healthcheck[2:], "--pid", str(pid), *extra]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of metric `name` (all label sets) in Prometheus text format."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"no sample of {name}"
    return total
