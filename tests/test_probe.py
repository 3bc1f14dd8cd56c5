"""`radixserve probe`, the images' health check: it finds the port a service opened from that service's
own command line and environment (a flag beats its RS_* variable, as in the service), and its exit code
says whether the service answers there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.probe import probe_url
from shared.natsd import NatsServer
from tests.services_helpers import REPO_ROOT, ServiceProcess, free_port

ENTRY = ["/opt/venv/bin/python", "/opt/venv/bin/radixserve"]


def test_the_url_comes_from_the_services_flags_then_its_variables_then_its_defaults() -> None:
    assert probe_url([*ENTRY, "worker"], {}) == "http://127.0.0.1:9402/metrics"
    assert probe_url([*ENTRY, "tokenizer"], {"RS_METRICS_PORT": "9600"}) == "http://127.0.0.1:9600/metrics"
    assert probe_url([*ENTRY, "detokenizer", "--metrics-port", "9500"], {"RS_METRICS_PORT": "9600"}) == "http://127.0.0.1:9500/metrics"
    assert probe_url([*ENTRY, "gateway"], {"RS_PORT": "8100", "RS_HOST": "0.0.0.0"}) == "http://127.0.0.1:8100/health"
    assert probe_url([*ENTRY, "gateway", "--port", "8200"], {}, ready=True) == "http://127.0.0.1:8200/ready"
    assert probe_url([*ENTRY, "worker", "--metrics-host", "10.1.2.3"], {}) == "http://10.1.2.3:9402/metrics"


def test_nothing_to_probe_is_an_error_that_says_why() -> None:
    with pytest.raises(ValueError, match="metrics are off"):
        probe_url([*ENTRY, "worker"], {"RS_METRICS_PORT": "none"})
    with pytest.raises(ValueError, match="no radixserve service"):
        probe_url(["nginx", "-g", "daemon off;"], {})
    with pytest.raises(ValueError, match="does not parse"):
        probe_url([*ENTRY, "tokenizer", "--no-such-flag"], {})


def test_probe_answers_for_a_running_gateway(nats: NatsServer, tmp_path: Path) -> None:
    port = free_port()
    gateway = ServiceProcess.start("gateway", ["--nats-url", nats.url, "--grpc-port", "0"], tmp_path,
                                   env={"RS_PORT": str(port)})
    try:
        gateway.wait_ready()

        def probe(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "services.cli", "probe", "--pid", str(gateway.proc.pid), *extra],
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

        assert probe().returncode == 0
        not_ready = probe("--ready")  # alive, but no worker serves
        assert not_ready.returncode == 1 and f"127.0.0.1:{port}/ready answered 503" in not_ready.stderr
        assert gateway.terminate() == 0
        gone = probe()
        assert gone.returncode == 2 and "No such file" in gone.stderr  # no such process any more
    finally:
        gateway.kill()
