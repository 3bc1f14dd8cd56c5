"""The gateway's watchdog (services/gateway/liveness.py) against a scripted pipeline on a real nats-server:
which silences end a request, which do not, and that every request it ends is aborted on its worker.

- A request queued on a worker that is making progress is not "no output": it is kept past
  --first-output-timeout (its worker says it holds it).
- A request its worker does not hold (lost on the way) ends with a 504 naming that, and is aborted.
- A request on a worker that is publishing no steps ends with a 504 and is aborted there.
- A worker that stops reporting and answering but keeps its subscriptions (a wedged process) keeps its
  requests until --worker-dead-after, then they are aborted there and end with a 503.
- A worker restarted under its id (a new instance) loses the requests sent to the old process: 503.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from shared.natsd import NatsServer
from shared.protocol import PROTOCOL_VERSION, WorkerLoad
from tests.gateway_helpers import FAKE_MODEL, LOAD_INTERVAL_S, FakePipeline, GatewayThread, wait_for_workers


def gateway_for(nats: NatsServer, prefix: str, workers: tuple[str, ...], progress: bool = False,
                **overrides: object) -> tuple[FakePipeline, GatewayThread]:
    fake = FakePipeline(nats.url, workers=workers, prefix=prefix, progress=progress)
    gw = GatewayThread(nats.url, subject_prefix=prefix, **overrides)
    wait_for_workers(gw.url, len(workers))
    return fake, gw


def error_message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def test_a_request_queued_on_a_progressing_worker_is_kept_past_the_first_output_timeout(nats: NatsServer) -> None:
    fake, gw = gateway_for(nats, "queued", ("q1",), progress=True, first_output_timeout=1.0)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gw.url}/generate", json={"text": "SILENT in the queue", "rid": "queued-1"}, timeout=3.5)
        # The client gave up (and so aborted it); until then the watchdog asked and kept it.
        assert ("q1", "status") in fake.controls
        fake.wait_until(lambda: ("q1", "queued-1") in fake.aborts)
    finally:
        gw.close()
        fake.close()


@pytest.mark.parametrize(
    ("progress", "prompt", "reason"),
    [
        (True, "LOST on the way", "worker w9 does not hold it"),  # its worker is busy with others
        (False, "SILENT forever", "no output for request"),  # its worker publishes no steps
    ],
)
def test_a_request_that_will_not_answer_is_aborted_with_504(
    nats: NatsServer, progress: bool, prompt: str, reason: str
) -> None:
    fake, gw = gateway_for(nats, f"quiet{int(progress)}", ("w9",), progress=progress, first_output_timeout=1.0)
    try:
        response = httpx.post(f"{gw.url}/generate", json={"text": prompt, "rid": "quiet-1"}, timeout=10)
        fake.wait_until(lambda: ("w9", "quiet-1") in fake.aborts)
    finally:
        gw.close()
        fake.close()
    assert response.status_code == 504
    assert reason in error_message(response)


def test_a_wedged_worker_keeps_its_requests_until_worker_dead_after_then_they_are_aborted(nats: NatsServer) -> None:
    fake, gw = gateway_for(nats, "wedged", ("x1",), worker_ttl=1.0, worker_dead_after=4.0, max_migrations=0)
    try:
        with httpx.Client(base_url=gw.url, timeout=15) as http:
            with http.stream("POST", "/generate", json={"text": "HANG on", "rid": "wedged-1", "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                fake.stall_worker("x1")
                stalled_at = time.monotonic()
                rest = [line for line in lines if line.startswith("data: ")]
                ended_after = time.monotonic() - stalled_at
    finally:
        gw.close()
        fake.close()
    assert "stopped responding" in rest[-2]
    # Silent from its last report before the stall (at most one report interval earlier) on: not given
    # up before worker_dead_after, and soon after it.
    assert 4.0 - LOAD_INTERVAL_S <= ended_after < 7.0


def test_a_worker_restarted_under_its_id_loses_the_old_processs_requests(nats: NatsServer) -> None:
    fake, gw = gateway_for(nats, "restart", ("r1",), max_migrations=0)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{gw.url}/generate", json={"text": "SILENT until restart"}, timeout=10)
            fake.wait_until(lambda: fake.in_flight("r1"))
            fake.restart_worker("r1")
            response = pending.result()
        after = httpx.post(f"{gw.url}/generate", json={"text": "a b c"}, timeout=10)
    finally:
        gw.close()
        fake.close()
    assert response.status_code == 503
    assert "worker r1 restarted" in error_message(response)
    assert after.status_code == 200 and after.json()["text"] == "a b c "


def test_a_killed_workers_stream_moves_once_with_no_repeat_and_no_gap_then_a_second_loss_is_a_503(
    nats: NatsServer,
) -> None:
    fake = FakePipeline(nats.url, workers=("m1", "m2"), prefix="move", step_s=0.25)
    gw = GatewayThread(nats.url, subject_prefix="move")
    words = [f"w{i}" for i in range(14)]
    try:
        wait_for_workers(gw.url, 2)
        with httpx.Client(base_url=gw.url, timeout=15) as http:
            body = {"text": " ".join(words), "rid": "moving", "stream": True}
            with http.stream("POST", "/generate", json=body) as response:
                texts, killed = [], []
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    texts.append(event["text"])
                    if len(texts) in (2, 8):
                        (victim,) = {s.worker_id for s in gw.service.dispatcher.hub.in_flight()}
                        fake.kill_worker(victim)
                        killed.append(victim)
        metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    finally:
        gw.close()
        fake.close()
    assert sorted(killed) == ["m1", "m2"]  # the second kill hit the worker it had moved to
    # Native /generate streams the whole text so far: every word once, in order, up to the second loss.
    assert texts == ["".join(f"{w} " for w in words[:n]) for n in range(1, 9)]
    assert "not moved: 1 of --max-migrations 1 used" in error
    assert f'rs_gateway_migrations_total{{model_name="{FAKE_MODEL}"}} 1.0' in metrics


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_request_past_its_own_timeout_is_aborted_with_504(nats: NatsServer, path: str) -> None:
    fake, gw = gateway_for(nats, "deadline", ("d1",))
    body = {"text": "HANG here", "rid": "late-1"} if path == "/generate" else {"prompt": "HANG here", "rid": "late-1"}
    try:
        started = time.monotonic()
        response = httpx.post(f"{gw.url}{path}", json=body | {"timeout": 1.0}, timeout=10)
        took = time.monotonic() - started
        fake.wait_until(lambda: ("d1", "late-1") in fake.aborts)
        bad = httpx.post(f"{gw.url}{path}", json=body | {"timeout": 0}, timeout=10)
    finally:
        gw.close()
        fake.close()
    assert response.status_code == 504 and "timed out" in error_message(response)
    assert 1.0 <= took < 3.0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"


def test_a_report_from_another_instance_that_the_worker_denies_ends_nothing(nats: NatsServer) -> None:
    """A WorkerLoad under a live worker's id with another instance (forged, stale, or a second process
    on one id) is checked with a ping first: the live worker answers as itself, so it is ignored."""
    fake, gw = gateway_for(nats, "forged", ("f1",), max_migrations=0)
    forged = WorkerLoad(v=PROTOCOL_VERSION, worker_id="f1", model=FAKE_MODEL, num_running=0, num_waiting=0,
                        kv_usage=0.0, cache_hit_rate=0.0, max_total_tokens=1000, context_len=64,
                        timestamp=time.time(), instance="impostor")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{gw.url}/generate", json={"text": "HANG in there", "rid": "kept"}, timeout=10)
            fake.wait_until(lambda: fake.in_flight("f1"))
            for _ in range(3):
                fake.thread.run(fake.bus.publish(fake.bus.subjects.workers_load, forged))
                time.sleep(0.3)
            assert gw.service.dispatcher.hub.get("kept") is not None  # still in flight, not failed
            assert gw.service.dispatcher.registry.get("f1").load.instance == "first"
            httpx.post(f"{gw.url}/abort_request", json={"rid": "kept"}, timeout=5)
            response = pending.result()
    finally:
        gw.close()
        fake.close()
    assert response.status_code == 200 and response.json()["meta_info"]["finish_reason"]["type"] == "abort"
