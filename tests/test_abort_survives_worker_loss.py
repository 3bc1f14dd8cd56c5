"""An abort the client asked for outlives the worker it was sent to (found by bench/soak.py): two real
worker processes serving the default model behind a real gateway, on a real nats-server.

A native stream is aborted by rid while its worker cannot act on it (SIGSTOPped, then SIGKILLed). The
gateway then loses the worker with the request still open; it must end the stream with the abort its
client asked for, not move it to the other worker to run to max_new_tokens.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.natsd import NatsServer
from tests.gateway_helpers import GatewayThread, wait_for_workers
from tests.services_helpers import ServiceProcess, metric_value

PREFIX = "abortlost"


@pytest.fixture(scope="module")
def workers(nats: NatsServer, default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProcess]]:
    log_dir = tmp_path_factory.mktemp("abort_lost_logs")
    args = ["--nats-url", nats.url, "--subject-prefix", PREFIX, "--metrics-port", "0", "--model-path",
            str(default_model_path), "--with-detokenizer", "--max-total-tokens", "4096"]
    started = {wid: ServiceProcess.start("worker", [*args, "--worker-id", wid], log_dir, label=wid) for wid in ("a", "b")}
    try:
        for worker in started.values():
            worker.wait_ready()
        yield started
    finally:
        for worker in started.values():
            worker.kill()


def test_a_stream_aborted_by_rid_whose_worker_dies_ends_aborted_instead_of_moving(
    nats: NatsServer, workers: dict[str, ServiceProcess], default_model_path: Path
) -> None:
    gateway = GatewayThread(nats.url, subject_prefix=PREFIX, local_tokenizer=str(default_model_path), control_timeout=1.0)
    finals: list[dict[str, object]] = []
    tokens = 0
    killed_at: float | None = None
    try:
        wait_for_workers(gateway.url, 2, timeout=30)
        body = {"text": "Write a long story about a lighthouse.", "rid": "abort-then-lost", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            with http.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    tokens = len(event["output_ids"])
                    if event["meta_info"]["finish_reason"] is not None:
                        finals.append(event["meta_info"]["finish_reason"])
                    if killed_at is not None:
                        continue
                    victim = workers[gateway.service.dispatcher.hub.get("abort-then-lost").worker_id]
                    victim.proc.send_signal(signal.SIGSTOP)  # it can take no abort now
                    answer = http.post("/abort_request", json={"rid": "abort-then-lost"})
                    assert answer.status_code == 200 and answer.json()["in_flight_here"] == 1
                    victim.kill()
                    killed_at = time.monotonic()
        assert killed_at is not None
        took = time.monotonic() - killed_at
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    finally:
        gateway.close()
    assert [f["type"] for f in finals] == ["abort"]
    assert tokens < 200
    assert took < 5.0
    assert metric_value(metrics, "rs_gateway_migrations_total", f'model_name="{default_model_path.name}"') == 0.0
