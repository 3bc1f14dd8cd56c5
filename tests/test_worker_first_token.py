"""A CPU scheduler thread hands a request's first token over before it starts the next step.

The worker service's scheduler thread calls `_outputs_from_thread` after each step. When a step gave
some request its first output and the scheduler computes on the CPU, the call returns only once the
event loop has written that step's message (or after FIRST_TOKEN_WAIT_S); any other step is handed
over without waiting. Here the service runs without NATS or a model: a scripted `_send` stands in for
the publish, and the scheduler thread is a plain thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from services.worker.frontend import service as worker_service
from services.worker.frontend.output_batcher import Flight
from services.worker.frontend.service import WorkerService
from services.worker.frontend.service_config import WorkerServiceConfig
from services.worker.scheduler.output import ReqOutput
from shared.protocol import BatchTokenOut

SEND_S = 0.2  # how long the scripted publish takes


@pytest.fixture(autouse=True)
def private_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    real = worker_service.WorkerMetrics
    monkeypatch.setattr(worker_service, "WorkerMetrics", lambda *args: real(*args, registry=CollectorRegistry()))
    # Ample for the scripted publish (the service's own bound is milliseconds), except where a test sets it.
    monkeypatch.setattr(worker_service, "FIRST_TOKEN_WAIT_S", 10 * SEND_S)


def run_steps(steps: list[list[ReqOutput]], await_first_tokens: bool, send_s: float = SEND_S) -> list[tuple[str, float]]:
    """Feed `steps` from a scheduler thread; the timeline of ('returned', t) for each hand-over and
    ('written', t) for each message the loop finished writing."""
    events: list[tuple[str, float]] = []

    async def main() -> None:
        service = WorkerService(WorkerServiceConfig(worker_id="w", served_model_name="tiny"))
        service._loop = asyncio.get_running_loop()
        service._loop_thread = threading.get_ident()
        service._await_first_tokens = await_first_tokens
        for rid in {out.rid for step in steps for out in step}:
            service._flights[rid] = Flight(gateway_id="g", stop=[], skip_special_tokens=True)

        async def send(batch: BatchTokenOut) -> None:
            await asyncio.sleep(send_s)
            events.append(("written", time.monotonic()))

        service._send = send  # type: ignore[method-assign]
        publisher = asyncio.create_task(service._publish_steps())

        def scheduler() -> None:
            for outputs in steps:
                service._outputs_from_thread(outputs)
                events.append(("returned", time.monotonic()))

        await asyncio.to_thread(scheduler)
        while sum(kind == "written" for kind, _ in events) < len(steps):
            await asyncio.sleep(0.01)
        service._steps.put_nowait(None)
        await publisher

    asyncio.run(main())
    return sorted(events, key=lambda e: e[1])


def test_a_first_token_is_written_before_the_next_step() -> None:
    events = run_steps([[ReqOutput("a", [7])]], await_first_tokens=True)
    assert [kind for kind, _ in events] == ["written", "returned"]


def test_later_tokens_do_not_wait() -> None:
    # The second step of "a" is not its first output: the scheduler goes on while it is written.
    events = run_steps([[ReqOutput("a", [7])], [ReqOutput("a", [8])]], await_first_tokens=True)
    assert [kind for kind, _ in events] == ["written", "returned", "returned", "written"]


def test_a_gpu_or_process_scheduler_never_waits() -> None:
    events = run_steps([[ReqOutput("a", [7])]], await_first_tokens=False)
    assert [kind for kind, _ in events] == ["returned", "written"]


def test_the_wait_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # A publish that takes far longer than FIRST_TOKEN_WAIT_S (NATS stalled) holds the step no longer.
    monkeypatch.setattr(worker_service, "FIRST_TOKEN_WAIT_S", 0.05)
    events = run_steps([[ReqOutput("a", [7])]], await_first_tokens=True, send_s=1.0)
    assert [kind for kind, _ in events] == ["returned", "written"]
    assert events[1][1] - events[0][1] > 0.5  # it returned long before the message was written
