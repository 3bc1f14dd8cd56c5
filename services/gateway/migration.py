"""Requests whose worker is lost, and requests that stopped: the dispatcher's side of the watchdog
(liveness.py).

A gone worker's requests migrate: each goes to a live worker with its prompt and the tokens its client
already has (`resume_ids`, `resume_chars` on its TokenizeRequest), and its stream goes on with no
repeat and no gap, at most --max-migrations times, then a clean 503. A request whose client asked for
its abort is not run again: it ends as the worker's abort final would have. A request that took too
long ends with the watchdog's error and is aborted on its worker.

The Dispatcher owns one Migrations and hands it what it needs from itself (publishing a request,
aborting one on a worker, spawning a tracked task), so this module imports nothing of dispatch.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from services.gateway.config import GatewayConfig
from services.gateway.errors import SERVICE_UNAVAILABLE
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import WorkerEntry, WorkerRegistry
from services.gateway.streams import RequestStream, StreamHub
from shared.protocol import Finish, StreamOut, TokenizeRequest, Usage

logger = logging.getLogger(__name__)

# The Dispatcher's own operations a migration uses.
Publish = Callable[[RequestStream, TokenizeRequest, WorkerEntry], Awaitable[None]]
SendAbort = Callable[[str, str], Coroutine[Any, Any, None]]
Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Migrations:
    """Moves a lost worker's requests to live workers, or ends them (module docstring)."""

    def __init__(
        self, config: GatewayConfig, registry: WorkerRegistry, hub: StreamHub, metrics: GatewayMetrics,
        publish: Publish, send_abort: SendAbort, spawn: Spawn,
    ) -> None:
        self.config = config
        self.registry = registry
        self.hub = hub
        self.metrics = metrics
        self._publish = publish
        self._send_abort = send_abort
        self._spawn = spawn

    def worker_lost(self, worker_id: str, reason: str, instance: str | None = None, abort: bool = False) -> None:
        """`worker_id` (or, with `instance`, that process of it) is gone: each of its requests here
        moves to a live worker or ends with a 503. `abort`: the worker may still run them (it stopped
        answering, not existing), so they are aborted there first."""
        if instance is None:
            self.registry.forget(worker_id)
        lost = [s for s in self.hub.in_flight() if s.worker_id == worker_id and (instance is None or s.instance == instance)]
        logger.warning("%s; %d in-flight request(s) here", reason, len(lost))
        for stream in lost:
            if abort:
                self._spawn(self._send_abort(worker_id, stream.rid))
            self._spawn(self._migrate(stream, reason))

    async def _migrate(self, stream: RequestStream, reason: str) -> None:
        """Send a lost worker's request to a live one, with the tokens its client already has; past
        --max-migrations, or with no live worker for its model, a clean 503."""
        if stream.finished:
            return
        if stream.abort_asked:
            # Its worker may have taken the abort and died before sending the final: end it as that
            # final would have, rather than run it again elsewhere.
            stream.deliver(StreamOut(rid=stream.rid, text="", token_ids=[], usage=Usage(completion_tokens=len(stream.delivered_ids)),
                                     finish=Finish(type="abort", message="aborted by request")))
            self.hub.close(stream)
            return
        if stream.request is None or stream.migrations >= self.config.max_migrations:
            self._fail(stream, SERVICE_UNAVAILABLE, f"{reason} (request {stream.rid} not moved: "
                       f"{stream.migrations} of --max-migrations {self.config.max_migrations} used)")
            return
        worker = self.registry.choose(stream.model, self.hub.per_worker())
        if worker is None:
            self._fail(stream, SERVICE_UNAVAILABLE, f"{reason}; no other live worker serves this request's model")
            return
        msg = msgspec.structs.replace(
            stream.request, worker_id=worker.load.worker_id,
            resume_ids=list(stream.delivered_ids) or None, resume_chars=stream.delivered_chars,
        )
        stream.worker_id, stream.instance = worker.load.worker_id, worker.load.instance
        stream.migrations += 1
        stream.checked_at = None
        try:
            await self._publish(stream, msg, worker)
        except Exception as exc:  # noqa: BLE001 - the client gets the error; the gateway goes on
            self._fail(stream, SERVICE_UNAVAILABLE, f"{reason}; moving request {stream.rid} failed: {exc}")
            return
        self.metrics.migrations.labels(stream.model_name).inc()
        logger.info("request %s moved to worker %s after %d token(s) (%s)", stream.rid, worker.load.worker_id,
                    len(stream.delivered_ids), reason)

    def give_up(self, stream: RequestStream, status: int, message: str) -> None:
        """End a request that took too long with an error, and abort it on its worker."""
        if stream.finished:
            return
        self._fail(stream, status, message)
        self._spawn(self._send_abort(stream.worker_id, stream.rid))

    def _fail(self, stream: RequestStream, status: int, message: str) -> None:
        stream.fail(status, message)
        self.hub.close(stream)
