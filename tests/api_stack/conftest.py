"""One `radixserve up` on the tiny seeded Qwen3, shared by this package's test modules, which drive a
whole stack through its three doors (HTTP, gRPC, the NATS front door) and change nothing in it: starting
one costs most of such a module's time. It is package-scoped, so it stops when the package's last test
has run: other tests look for `services.cli` processes in /proc and must not find these."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.services_helpers import free_port, start_up

SERVED_MODEL = "tiny"


@dataclass
class Up:
    """The three doors of one `radixserve up`."""

    url: str
    grpc_target: str
    nats: dict[str, str]  # the NATS front door's client login, as `up` wrote it: url, user, password, namespace


@pytest.fixture(scope="package")
def tiny_up(qwen3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`up` serving qwen3_path as "tiny" with the hermes tool-call parser, a 2,048-token pool, its own
    nats-server (RS_NATS_URL names an address nothing answers on) and one compute thread per service."""
    tmp = tmp_path_factory.mktemp("tiny_up")
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    grpc_port = free_port()
    proc = start_up([
        "--model-path", str(qwen3_path), "--served-model-name", SERVED_MODEL, "--max-total-tokens", "2048",
        "--tool-call-parser", "hermes", "--port", str(free_port()), "--grpc-port", str(grpc_port),
        "--run-dir", str(tmp / "run"),
    ], env, tmp / "up.out")
    try:
        url = re.search(r"radixserve is up: (http://\S+)", (tmp / "up.out").read_text()).group(1)
        yield Up(url, f"127.0.0.1:{grpc_port}", json.loads((tmp / "run" / "nats-client.json").read_text()))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
