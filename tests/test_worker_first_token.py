"""A CPU scheduler thread hands a request's first token over before it starts the next step.

The worker service's scheduler thread calls `_outputs_from_thread` after each step. When a step gave
some request its first output and the scheduler computes on the CPU, the call returns only once the
event loop has written that step's message (or after FIRST_TOKEN_WAIT_S); any other step is handed
over without waiting. Here the service runs without NATS or a model: a scripted `_send` stands in for
the publish, and the scheduler thread is a plain thread. A scheduler process does the same across its
inbox: the worker's loop sends FirstTokensOut once such a step's message is written, and the scheduler
loop (scripted steps here) waits for it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from types import SimpleNamespace

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


def scripted_service(
    steps: list[list[ReqOutput]], events: list[tuple[str, float]], send_s: float
) -> tuple[WorkerService, asyncio.Task[None]]:
    """On the running loop: a worker service with a flight for every request of `steps`, whose publish
    takes send_s and logs ('written', t), and its step publisher running."""
    service = WorkerService(WorkerServiceConfig(worker_id="w", served_model_name="tiny"))
    service._loop = asyncio.get_running_loop()
    service._loop_thread = threading.get_ident()
    for rid in {out.rid for step in steps for out in step}:
        service._flights[rid] = Flight(gateway_id="g", stop=[], skip_special_tokens=True)

    async def send(batch: BatchTokenOut) -> None:
        await asyncio.sleep(send_s)
        events.append(("written", time.monotonic()))

    service._send = send  # type: ignore[method-assign]
    return service, asyncio.create_task(service._publish_steps())


def run_steps(steps: list[list[ReqOutput]], await_first_tokens: bool, send_s: float = SEND_S) -> list[tuple[str, float]]:
    """Feed `steps` from a scheduler thread; the timeline of ('returned', t) for each hand-over and
    ('written', t) for each message the loop finished writing."""
    events: list[tuple[str, float]] = []

    async def main() -> None:
        service, publisher = scripted_service(steps, events, send_s)
        service._await_first_tokens = await_first_tokens

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


def run_loop_steps(steps: list[list[ReqOutput]]) -> list[tuple[str, float]]:
    """The process form: a scheduler process's steps reach `_outputs_from_thread` on the event loop; the
    timeline of ('written', t) and ('acknowledged', t) for each FirstTokensOut sent to the scheduler."""
    events: list[tuple[str, float]] = []

    class Client:
        def first_tokens_out(self) -> None:
            events.append(("acknowledged", time.monotonic()))

    async def main() -> None:
        service, publisher = scripted_service(steps, events, SEND_S)
        service._ack_first_tokens = True
        service.client = Client()  # type: ignore[assignment]
        service.bus = SimpleNamespace(poller=SimpleNamespace(touch=lambda: None))  # type: ignore[assignment]
        for outputs in steps:
            service._outputs_from_thread(outputs)
            while sum(kind == "written" for kind, _ in events) < steps.index(outputs) + 1:
                await asyncio.sleep(0.01)
        service._steps.put_nowait(None)
        await publisher

    asyncio.run(main())
    return sorted(events, key=lambda e: e[1])


def test_a_scheduler_process_hears_when_a_first_token_is_out() -> None:
    # Only the step with "a"'s first output is acknowledged, once its message is written.
    events = run_loop_steps([[ReqOutput("a", [7])], [ReqOutput("a", [8])]])
    assert [kind for kind, _ in events] == ["written", "acknowledged", "written"]


def test_a_scheduler_process_waits_for_the_first_tokens_to_go_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler side: after a step that gave "a" its first output, the loop starts no step until
    FirstTokensOut (a command that came meanwhile is applied first, not lost); a later output of "a"
    does not wait; without HandOverFirstTokens nothing waits."""
    from services.worker.frontend import scheduler_loop

    monkeypatch.setattr(scheduler_loop, "FIRST_TOKEN_WAIT_S", 30.0)

    class Scheduler:
        def __init__(self) -> None:
            self.script = [[ReqOutput("a", [7])], [ReqOutput("a", [8])], [ReqOutput("a", [9])]]
            self.log: list[str] = []

        def has_work(self) -> bool:
            return bool(self.script)

        def step(self) -> list[ReqOutput]:
            self.log.append("step")
            return self.script.pop(0) if self.script else []

        def abort_request(self, rid: str, reason: object) -> None:
            self.log.append(f"abort {rid}")

    def start(hand_over: bool) -> tuple[Scheduler, queue.Queue[object], threading.Thread]:
        loop = scheduler_loop.SchedulerLoop.__new__(scheduler_loop.SchedulerLoop)
        loop.config, loop.rank, loop.scheduler = SimpleNamespace(world_size=lambda: 1), 0, Scheduler()
        loop._stall, loop.adaptive, loop._idle_beat_s = None, None, 2.0
        loop.loop_seconds = {"commands": 0.0, "step": 0.0, "hand_off": 0.0}
        loop._init_hand_over()
        inbox: queue.Queue[object] = queue.Queue()
        if hand_over:
            inbox.put(scheduler_loop.HandOverFirstTokens())
        thread = threading.Thread(target=loop.run, args=(inbox, queue.Queue()), daemon=True)
        thread.start()
        return loop.scheduler, inbox, thread

    scheduler, inbox, thread = start(hand_over=True)
    time.sleep(0.3)
    assert scheduler.log == ["step"]  # waiting for the first token to go out
    inbox.put(scheduler_loop.AbortReq("x"))
    time.sleep(0.1)
    assert scheduler.log == ["step"]
    inbox.put(scheduler_loop.FirstTokensOut())
    time.sleep(0.3)
    assert scheduler.log == ["step", "abort x", "step", "step"]
    inbox.put(scheduler_loop.Shutdown())
    thread.join(5)

    scheduler, inbox, thread = start(hand_over=False)
    time.sleep(0.3)
    assert scheduler.log == ["step", "step", "step"]
    inbox.put(scheduler_loop.Shutdown())
    thread.join(5)
