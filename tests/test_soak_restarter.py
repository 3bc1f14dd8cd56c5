"""bench/soak.py's Restarter, over a stand-in deployment: it kills a worker only once that worker's
scheduler, asked right then, holds requests (the worker's running-requests gauge lags by up to a load
interval: a 36 s soak once killed a worker the gauge called busy and caught nothing to move), gives an
idle one up to KILL_WAIT_S, and records what the kill caught."""

from __future__ import annotations

import time

from bench.soak import KILL_WAIT_S, Restarter


class StaleGauge:
    """A worker process whose rs_worker_running_requests gauge still shows requests it finished."""

    def metric(self, name: str) -> float:
        return 3.0


class Deployment:
    """The SoakStack calls a Restarter makes; `held` is what each requests_on call finds, in order."""

    def __init__(self, held: list[int]) -> None:
        self.workers = {"w0": StaleGauge(), "w1": StaleGauge()}
        self.held = held
        self.asked: list[str] = []
        self.killed: list[str] = []

    def requests_on(self, wid: str) -> int:
        self.asked.append(wid)
        return self.held.pop(0)

    def kill_and_start(self, wid: str) -> None:
        self.killed.append(wid)

    def restart_ready(self, wid: str) -> bool:
        return True


def test_the_kill_waits_until_the_scheduler_itself_holds_requests() -> None:
    stack = Deployment(held=[0, 0, 2])
    restarter = Restarter(stack, every_s=5.0, started=time.monotonic() - 5.0)  # type: ignore[arg-type]
    restarter.tick()
    restarter.tick()
    assert stack.killed == [] and restarter.pending is None  # the stale gauge says 3: no kill on it
    restarter.tick()
    assert stack.killed == ["w0"] and stack.asked == ["w0"] * 3
    assert restarter.pending is not None and restarter.pending["running_at_kill"] == 2
    restarter.tick()  # the restarted worker is ready
    assert [r["worker"] for r in restarter.done] == ["w0"] and restarter.done[0]["running_at_kill"] == 2
    assert restarter.next_at > time.monotonic()  # the next kill (w1) waits for its turn


def test_an_idle_worker_is_killed_anyway_after_the_wait() -> None:
    stack = Deployment(held=[0])
    restarter = Restarter(stack, every_s=5.0, started=time.monotonic() - 5.0 - KILL_WAIT_S - 1.0)  # type: ignore[arg-type]
    restarter.tick()
    assert (
        stack.killed == ["w0"] and restarter.pending is not None and restarter.pending["running_at_kill"] == 0
    )
