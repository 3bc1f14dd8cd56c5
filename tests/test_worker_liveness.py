"""Liveness is not load, and a lost worker's requests move on: real worker processes serving the default
model behind a real gateway, on a real nats-server.

- A scheduler blocked for longer than --worker-dead-after (fault injection: RS_FAULT_STALL), on a host
  loaded on purpose (two processes spinning), keeps every request: its heartbeat does not wait for the
  scheduler, and each answer equals the offline Engine's.
- A SIGKILLed worker is detected within seconds; its streamed request continues on the other worker
  with no repeat and no gap, and the whole answer equals an uninterrupted greedy run.
- With --max-migrations 0 the same loss is a clean 503 error event, not a hang.
- A worker id that a live worker holds is refused at start (exit 1, saying so); once its holder is gone
  the id can be taken again, and the gateways use it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.worker.frontend.engine import Engine
from shared.natsd import NatsServer
from shared.service import die_with_parent
from tests.gateway_helpers import GatewayThread, wait_for_workers
from tests.services_helpers import ServiceProcess, metric_value

QUESTION = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
STALL_S = 8.0


@dataclass
class Deployment:
    nats: NatsServer
    gateway: GatewayThread
    workers: dict[str, ServiceProcess]
    log_dir: Path
    worker_args: list[str]


def start_worker(nats_url: str, model: Path, wid: str, log_dir: Path, prefix: str,
                 env: dict[str, str] | None = None, label: str | None = None) -> ServiceProcess:
    args = ["--nats-url", nats_url, "--subject-prefix", prefix, "--metrics-port", "0", "--model-path", str(model), "--worker-id", wid,
            "--with-detokenizer", "--max-total-tokens", "4096"]
    return ServiceProcess.start("worker", args, log_dir, label=label or wid, env=env)


@pytest.fixture(scope="module")
def pair(nats: NatsServer, default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two workers (a, b) and a gateway that tokenizes for them."""
    log_dir = tmp_path_factory.mktemp("liveness_logs")
    workers = {wid: start_worker(nats.url, default_model_path, wid, log_dir, "pair") for wid in ("a", "b")}
    gateway = None
    try:
        for worker in workers.values():
            worker.wait_ready()
        gateway = GatewayThread(nats.url, subject_prefix="pair", local_tokenizer=str(default_model_path))
        wait_for_workers(gateway.url, 2, timeout=30)
        yield Deployment(nats, gateway, workers, log_dir, [])
    finally:
        if gateway is not None:
            gateway.close()
        for worker in workers.values():
            worker.kill()


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """Load the host on purpose: `count` processes spinning on a core each."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def greedy_chat(engine: Engine, max_tokens: int) -> dict[str, object]:
    prompt = engine.apply_chat_template(QUESTION)
    return engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True})


def chat_body(model: Path, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": model.name, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}}


def test_a_scheduler_blocked_past_worker_dead_after_keeps_every_request(
    nats: NatsServer, default_model_path: Path, engine: Engine, tmp_path: Path
) -> None:
    worker = start_worker(nats.url, default_model_path, "slow", tmp_path, "stall", env={"RS_FAULT_STALL": f"2:{STALL_S}"})
    gateway = None
    try:
        worker.wait_ready()
        gateway = GatewayThread(nats.url, subject_prefix="stall", local_tokenizer=str(default_model_path),
                                worker_ttl=2.0, worker_dead_after=3.0)
        wait_for_workers(gateway.url, 1, timeout=30)
        url = gateway.url

        def ask(_: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/chat/completions", json=chat_body(default_model_path, 12, False), timeout=120)

        started = time.monotonic()
        with cpu_hogs(2), concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(4)))
        took = time.monotonic() - started
    finally:
        if gateway is not None:
            gateway.close()
        worker.kill()
    assert "the scheduler blocks for 8 s" in worker.log()
    assert took > STALL_S  # the stall really held these requests
    expected = greedy_chat(engine, 12)["text"]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected


def test_a_killed_workers_stream_moves_to_the_other_worker_without_repeat_or_gap(
    pair: Deployment, default_model_path: Path, engine: Engine
) -> None:
    dispatcher = pair.gateway.service.dispatcher
    pieces: list[str] = []
    usage: dict[str, int] = {}
    with httpx.Client(base_url=pair.gateway.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(default_model_path, 64, True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            killed_at = None
            gap = 0.0
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if not event["choices"]:
                    continue
                pieces.append(event["choices"][0]["delta"].get("content") or "")
                if killed_at is not None and not gap and pieces[-1]:
                    gap = time.monotonic() - killed_at
                if len(pieces) == 6 and killed_at is None:
                    (stream,) = dispatcher.hub.in_flight()
                    victim = stream.worker_id
                    pair.workers[victim].kill()
                    killed_at = time.monotonic()
    expected = greedy_chat(engine, 64)
    assert "".join(pieces) == expected["text"]
    assert usage["completion_tokens"] == 64
    assert 0 < gap < 5.0, f"the stream resumed {gap:.1f} s after the kill"
    metrics = httpx.get(f"{pair.gateway.url}/metrics", timeout=5).text
    assert metric_value(metrics, "rs_gateway_migrations_total", f'model_name="{default_model_path.name}"') == 1.0
    # The killed worker's id is free again: a new process takes it and is routed to.
    survivor = "b" if victim == "a" else "a"
    pair.workers[victim] = start_worker(pair.nats.url, default_model_path, victim, pair.log_dir, "pair",
                                        label=f"{victim}-again")
    pair.workers[victim].wait_ready()
    wait_for_workers(pair.gateway.url, 2, timeout=30)
    assert {w.load.worker_id for w in dispatcher.registry.live()} == {victim, survivor}


def test_a_worker_id_held_by_a_live_worker_is_refused_at_start(pair: Deployment, default_model_path: Path) -> None:
    clash = start_worker(pair.nats.url, default_model_path, "a", pair.log_dir, "pair", label="a-clash")
    clash.proc.wait(timeout=60)
    assert clash.proc.returncode == 1
    assert "worker id 'a' is already served by a live worker in namespace 'pair'" in clash.log()
    answer = httpx.post(f"{pair.gateway.url}/v1/chat/completions", json=chat_body(default_model_path, 4, False), timeout=60)
    assert answer.status_code == 200, answer.text


def test_without_migration_a_killed_worker_ends_its_stream_with_a_503_event(
    nats: NatsServer, default_model_path: Path, tmp_path: Path
) -> None:
    worker = start_worker(nats.url, default_model_path, "solo", tmp_path, "nomove")
    gateway = None
    try:
        worker.wait_ready()
        gateway = GatewayThread(nats.url, subject_prefix="nomove", local_tokenizer=str(default_model_path),
                                max_migrations=0)
        wait_for_workers(gateway.url, 1, timeout=30)
        events: list[str] = []
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=chat_body(default_model_path, 200, True)) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3:
                        worker.kill()
                        killed_at = time.monotonic()
        took = time.monotonic() - killed_at
    finally:
        if gateway is not None:
            gateway.close()
        worker.kill()
    assert events[-1] == "[DONE]"
    assert "worker solo is gone" in json.loads(events[-2])["error"]["message"]
    assert took < 5.0


def test_a_draining_worker_leaves_the_gateways_routing_at_once(pair: Deployment, default_model_path: Path) -> None:
    extra = start_worker(pair.nats.url, default_model_path, "c", pair.log_dir, "pair")
    extra.wait_ready()
    registry = pair.gateway.service.dispatcher.registry
    wait_for_workers(pair.gateway.url, 3, timeout=30)
    extra.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 1.0  # well inside the 3 s TTL that silence alone would take
    while "c" in {w.load.worker_id for w in registry.live()}:
        assert time.monotonic() < deadline, "the draining worker is still routed to"
        time.sleep(0.02)
    assert extra.proc.wait(timeout=60) == 0
    answer = httpx.post(f"{pair.gateway.url}/v1/chat/completions", json=chat_body(default_model_path, 4, False), timeout=60)
    assert answer.status_code == 200, answer.text
