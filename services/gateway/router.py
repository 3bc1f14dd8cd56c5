"""The worker registry: which workers are alive (heard on `{p}.workers.load` recently), which model each
serves, and the least-loaded choice among them.

Loads arrive once a second, so between two reports a burst of requests would all pick the same worker.
A worker's queue is therefore taken as the larger of (its reported running + waiting requests, plus
what this gateway sent it since that report) and (this gateway's requests in flight on it), the latter
covering a report that was made before the worker saw this gateway's newest requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

from shared.protocol import WorkerLoad


@dataclass
class WorkerEntry:
    """One worker as this gateway knows it."""

    load: WorkerLoad
    last_seen: float  # time.monotonic() of the last report
    sent_since_report: int = 0

    def queued(self, in_flight_here: int = 0) -> int:
        return max(self.load.num_running + self.load.num_waiting + self.sent_since_report, in_flight_here)


def model_matches(requested: str, served: str) -> bool:
    """A request's `model` names a worker's model by its full name or its last path component (so a
    worker that reports a directory is still reachable by the model's short name)."""
    return requested == served or requested == PurePath(served).name


class WorkerRegistry:
    """Live workers, their loads, and routing."""

    def __init__(self, ttl_s: float, dead_s: float) -> None:
        self.ttl_s = ttl_s
        self.dead_s = dead_s
        self._workers: dict[str, WorkerEntry] = {}
        self._changed = asyncio.Event()

    def observe(self, load: WorkerLoad, now: float | None = None) -> None:
        """Record a WorkerLoad report."""
        self._workers[load.worker_id] = WorkerEntry(load, time.monotonic() if now is None else now)
        self._changed.set()
        self._changed = asyncio.Event()

    def live(self, model: str | None = None, now: float | None = None) -> list[WorkerEntry]:
        """Workers heard within the TTL (serving `model`, if given)."""
        now = time.monotonic() if now is None else now
        return [
            w
            for w in self._workers.values()
            if now - w.last_seen <= self.ttl_s and (model is None or model_matches(model, w.load.model))
        ]

    def models(self, now: float | None = None) -> list[str]:
        """The distinct models live workers serve, in a stable order."""
        return sorted({w.load.model for w in self.live(now=now)})

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def choose(
        self, model: str | None = None, in_flight_here: Mapping[str, int] | None = None, now: float | None = None
    ) -> WorkerEntry | None:
        """The least-loaded live worker for `model` (ties: lower KV usage, then id), counted as sent.
        `in_flight_here`: this gateway's unfinished requests per worker id."""
        candidates = self.live(model, now)
        if not candidates:
            return None
        local = in_flight_here or {}
        best = min(
            candidates, key=lambda w: (w.queued(local.get(w.load.worker_id, 0)), w.load.kv_usage, w.load.worker_id)
        )
        best.sent_since_report += 1
        return best

    def prune_dead(self, now: float | None = None) -> list[str]:
        """Forget workers silent for longer than dead_s; return their ids."""
        now = time.monotonic() if now is None else now
        dead = [wid for wid, w in self._workers.items() if now - w.last_seen > self.dead_s]
        for wid in dead:
            del self._workers[wid]
        return dead

    async def wait_for_worker(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for any live worker; True if there is one."""
        deadline = time.monotonic() + timeout
        while not self.live():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                return bool(self.live())
        return True
