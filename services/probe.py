"""`radixserve probe`: the container health check. It reads the service's own command line and
environment (PID 1's in a container, `--pid` elsewhere), finds the address that service opened with the
same flag and RS_* parsing the service used, and asks it:

    gateway                    GET /health (liveness: NATS connected), or /ready with --ready (a live
                               worker serves a model)
    tokenizer, detokenizer     GET /metrics on --metrics-port (served once it is subscribed)
    worker                     GET /metrics on --metrics-port (served only after the model is loaded)

Exit 0 on a 200, 1 otherwise (with the reason on stderr), 2 when there is nothing to probe (no service
in the command line, or its metrics are off).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

SERVICES = ("gateway", "tokenizer", "worker", "detokenizer")
TIMEOUT_S = 5.0


def read_process(pid: int) -> tuple[list[str], dict[str, str]]:
    """A process's argv and environment, from /proc."""
    proc = Path("/proc") / str(pid)
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
    env = dict(e.decode().split("=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
    return argv, env


def probe_url(argv: list[str], env: Mapping[str, str], ready: bool = False) -> str:
    """The URL that says whether the service run as `argv` (with `env`) is up; ValueError if none."""
    from services.cli import build_parser
    from shared import flags

    positions = [i for i, arg in enumerate(argv) if arg in SERVICES]
    if not positions:
        raise ValueError(f"no radixserve service ({', '.join(SERVICES)}) in the command line {argv!r}")
    service_args = argv[positions[0]:]
    try:
        args = build_parser().parse_args(service_args)
    except SystemExit:
        raise ValueError(f"the command line {service_args!r} does not parse (usage above)") from None
    service = service_args[0]
    if service == "gateway":
        from services.gateway.config import GatewayConfig

        values = flags.values_from(GatewayConfig, args, env)
        port = values.get("port", GatewayConfig.port)
        host = _local(values.get("host", GatewayConfig.host))
        return f"http://{host}:{port}/{'ready' if ready else 'health'}"
    config_class = config_classes(service)[0]
    values = flags.values_from(config_class, args, env, exclude=("engine",))
    port = values.get("metrics_port", config_class.metrics_port)
    if port is None or port == 0:
        raise ValueError(f"the {service}'s metrics are off or on a random port (--metrics-port {port}): nothing to probe")
    return f"http://{_local(values.get('metrics_host', '0.0.0.0'))}:{port}/metrics"


def config_classes(service: str) -> tuple[type, ...]:
    """The config dataclasses whose fields are `radixserve <service>`'s flags (and RS_* variables)."""
    if service == "gateway":
        from services.gateway.config import GatewayConfig

        return (GatewayConfig,)
    if service == "tokenizer":
        from services.tokenizer.config import TokenizerConfig

        return (TokenizerConfig,)
    if service == "detokenizer":
        from services.detokenizer.config import DetokenizerConfig

        return (DetokenizerConfig,)
    if service == "worker":
        from services.worker.config import EngineConfig
        from services.worker.frontend.service_config import WorkerServiceConfig

        return (WorkerServiceConfig, EngineConfig)
    raise ValueError(f"no radixserve service {service!r}; expected one of {', '.join(SERVICES)}")


def _local(host: str) -> str:
    """Where to reach a server bound to `host` from the same machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def check(url: str) -> str | None:
    """None when `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except OSError as exc:
        return f"{url} is unreachable: {exc}"


def add_probe_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    probe = subparsers.add_parser("probe", help="health check of a running service (a container's HEALTHCHECK)")
    probe.add_argument("--pid", type=int, default=1, help="the service's process id (default 1: a container's)")
    probe.add_argument("--ready", action="store_true", help="gateway: readiness (/ready) rather than liveness")
    probe.set_defaults(handler=_probe)


def _probe(args: argparse.Namespace) -> int:
    try:
        argv, env = read_process(args.pid)
        url = probe_url(argv, env, args.ready)
    except (OSError, ValueError) as exc:
        print(f"radixserve probe: {exc}", file=sys.stderr)
        return 2
    problem = check(url)
    if problem is not None:
        print(f"radixserve probe: {problem}", file=sys.stderr)
        return 1
    return 0
