"""The worker registry: which workers are live (heard on `{p}.workers.load` recently, so routable), which
model each serves, and the choice among them: cache-aware (SGLang router's rule) or least loaded.

Cache-aware routing: while the live workers' queues are balanced, a request goes to the worker that
was sent the longest prefix of its prompt (services/gateway/prefix_index.py), if that prefix is at
least `cache_threshold` of the prompt, so the worker's radix cache holds it; otherwise to the least
loaded. When the queues are imbalanced (longest - shortest > balance_abs_threshold and longest >
shortest * balance_rel_threshold) the least-loaded worker takes it, whatever it has cached.

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

from services.gateway.prefix_index import PrefixIndex
from shared.protocol import WorkerLoad

ROUTING_POLICIES = ("cache_aware", "least_loaded")


@dataclass
class WorkerEntry:
    """One worker as this gateway knows it."""

    load: WorkerLoad
    last_seen: float  # time.monotonic() of the last report
    sent_since_report: int = 0
    progress_at: float = 0.0  # time.monotonic() when its published step count last moved
    answered_at: float | None = None  # when it last answered a liveness probe (liveness.py)

    def queued(self, in_flight_here: int = 0) -> int:
        return max(self.load.num_running + self.load.num_waiting + self.sent_since_report, in_flight_here)


def model_matches(requested: str, served: str) -> bool:
    """A request's `model` names a worker's model by its full name or its last path component (so a
    worker that reports a directory is still reachable by the model's short name)."""
    return requested == served or requested == PurePath(served).name


class WorkerRegistry:
    """Live workers, their loads, and routing."""

    def __init__(
        self,
        ttl_s: float,
        dead_s: float,
        policy: str = "cache_aware",
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.ttl_s = ttl_s
        self.dead_s = dead_s
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.prefixes = PrefixIndex()
        self._workers: dict[str, WorkerEntry] = {}
        self._changed = asyncio.Event()

    def observe(self, load: WorkerLoad, now: float | None = None) -> str | None:
        """Record a WorkerLoad report. Returns the previous instance id when the report comes from a
        new process under a known worker id (the old one's requests are lost), else None."""
        now = time.monotonic() if now is None else now
        previous = self._workers.get(load.worker_id)
        entry = WorkerEntry(load, now, progress_at=now)
        restarted = None
        if previous is not None:
            if previous.load.instance != load.instance:
                restarted = previous.load.instance
            else:
                entry.answered_at = previous.answered_at
                if previous.load.steps == load.steps:
                    entry.progress_at = previous.progress_at
        self._workers[load.worker_id] = entry
        self._changed.set()
        self._changed = asyncio.Event()
        return restarted

    def progress_at(self, worker_id: str) -> float | None:
        """When `worker_id` last published a step (None for a worker not known here)."""
        entry = self._workers.get(worker_id)
        return entry.progress_at if entry is not None else None

    def all(self) -> list[WorkerEntry]:
        """Every worker known here, live or silent."""
        return list(self._workers.values())

    def forget(self, worker_id: str) -> None:
        """Drop a worker that is gone (and the prefixes routed to it)."""
        self._workers.pop(worker_id, None)
        self.prefixes.forget(worker_id)

    def live(self, model: str | None = None, now: float | None = None) -> list[WorkerEntry]:
        """Workers heard within the TTL and not draining (serving `model`, if given)."""
        now = time.monotonic() if now is None else now
        return [
            w
            for w in self._workers.values()
            if now - w.last_seen <= self.ttl_s and not w.load.draining
            and (model is None or model_matches(model, w.load.model))
        ]

    def models(self, now: float | None = None) -> list[str]:
        """The distinct models live workers serve, in a stable order."""
        return sorted({w.load.model for w in self.live(now=now)})

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def choose(
        self,
        model: str | None = None,
        in_flight_here: Mapping[str, int] | None = None,
        now: float | None = None,
        key: bytes | None = None,
    ) -> WorkerEntry | None:
        """A live worker for `model`, counted as sent: by the cache-aware rule (module docstring) when
        the policy is cache_aware and the request's routing `key` is given, else the least loaded
        (ties: lower KV usage, then id). `in_flight_here`: this gateway's unfinished requests per
        worker id."""
        candidates = self.live(model, now)
        if not candidates:
            return None
        local = in_flight_here or {}
        queued = {w.load.worker_id: w.queued(local.get(w.load.worker_id, 0)) for w in candidates}
        best = min(candidates, key=lambda w: (queued[w.load.worker_id], w.load.kv_usage, w.load.worker_id))
        if self.policy == "cache_aware" and key:
            chain = self.prefixes.chain(key)
            shortest, longest = min(queued.values()), max(queued.values())
            imbalanced = (
                longest - shortest > self.balance_abs_threshold and longest > shortest * self.balance_rel_threshold
            )
            if not imbalanced and len(candidates) > 1:  # with one candidate there is nothing to choose
                matched = self.prefixes.matched_bytes(key, queued, chain)
                top = max(candidates, key=lambda w: (matched[w.load.worker_id], -queued[w.load.worker_id]))
                if matched[top.load.worker_id] >= self.cache_threshold * len(key) and matched[top.load.worker_id]:
                    best = top
            # Recorded even so: a worker that joins later is then routed around what this one holds.
            self.prefixes.record(best.load.worker_id, key, chain)
        best.sent_since_report += 1
        return best

    def prune_dead(self, now: float | None = None, since: float = 0.0) -> list[str]:
        """Forget workers that have been silent, and have not answered a probe, for longer than dead_s
        (counting from `since` at the earliest: when this gateway's own connection came back); return
        their ids. A worker whose NATS connection is gone is caught sooner by liveness.py's probe."""
        now = time.monotonic() if now is None else now
        dead = [
            wid for wid, w in self._workers.items()
            if now - max(w.last_seen, w.answered_at or 0.0, since) > self.dead_s
        ]
        for wid in dead:
            self.forget(wid)
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
