"""What a container orchestrator relies on, with real processes: a request still running when a
worker's drain timeout ends gets an explicit error final (not silence) and the worker exits 0 soon after, so
a pod's terminationGracePeriodSeconds just over --drain-timeout is enough; and a service started before
NATS waits for it (RS_NATS_CONNECT_TIMEOUT) instead of crashing, so start order does not matter."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from shared.natsd import start_nats_server
from shared.protocol import Sampling
from tests.services_helpers import FakeGateway, ServiceProcess, free_port, run

pytestmark = pytest.mark.slow
DRAIN_TIMEOUT_S = 1.0


def test_a_request_running_past_the_drain_timeout_ends_with_an_error_final_and_the_worker_exits_0(
    default_model_path: Path, tmp_path: Path,
) -> None:
    with start_nats_server() as nats:
        common = ["--nats-url", nats.url, "--metrics-port", "none", "--model-path", str(default_model_path)]
        tokenizer = ServiceProcess.start("tokenizer", common, tmp_path)
        worker = ServiceProcess.start("worker", [*common, "--worker-id", "w1", "--with-detokenizer",
                                                 "--drain-timeout", str(DRAIN_TIMEOUT_S), "--max-total-tokens", "8192"], tmp_path)
        try:
            tokenizer.wait_ready()
            worker.wait_ready()

            async def main() -> tuple[object, float, float]:
                async with await FakeGateway.connect(nats.url, "g1") as gateway:
                    endless = Sampling(temperature=0.0, max_new_tokens=4000, ignore_eos=True)
                    await gateway.send(gateway.tokenize_request("long", "w1", sampling=endless, text="Once upon a time"))
                    first = await gateway.next_chunk("long")
                    worker.proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                    result = await gateway.collect("long", first=first)
                    return result, signalled, time.monotonic()

            result, signalled, ended = run(main())
            assert worker.proc.wait(timeout=30) == 0, worker.log()[-2000:]
            exited = time.monotonic()
        finally:
            worker.kill()
            tokenizer.kill()
    # An error that says why (the client did not ask for an abort), not silence and not 'abort'.
    assert result.finish.type == "error", result.finish  # type: ignore[attr-defined]
    assert "w1 shut down" in result.finish.message and "drain timeout" in result.finish.message  # type: ignore[attr-defined]
    assert result.finish.status == 503  # type: ignore[attr-defined]  # the server's doing: every door answers 503
    assert 0 < len(result.token_ids) < 4000  # type: ignore[attr-defined]
    # It ran for the drain timeout, no longer than a few steps past it, and the process left soon after.
    assert DRAIN_TIMEOUT_S <= ended - signalled < DRAIN_TIMEOUT_S + 10
    assert exited - signalled < DRAIN_TIMEOUT_S + 20
    assert "aborting 1 request(s) still running" in worker.log()


def test_a_service_started_before_nats_waits_for_it(tmp_path: Path) -> None:
    port = free_port()
    args = ["--nats-url", f"nats://127.0.0.1:{port}", "--port", "0", "--grpc-port", "0"]
    gateway = ServiceProcess.start("gateway", args, tmp_path, env={"RS_NATS_CONNECT_TIMEOUT": "60"})
    try:
        time.sleep(3.0)
        assert gateway.proc.poll() is None, gateway.log()[-2000:]  # still waiting, not crashed
        assert "gateway ready" not in gateway.log()
        with start_nats_server(port=port):
            gateway.wait_ready(timeout=60)
            assert gateway.terminate() == 0
    finally:
        gateway.kill()
