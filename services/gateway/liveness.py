"""Which workers are gone, and what happens to requests that stop moving: the gateway's watchdog.

Liveness is not load. A worker's WorkerLoad is its heartbeat, sent by its event loop and never waiting
for its scheduler, so a slow step does not silence it. A worker that falls silent anyway (its process
killed, its host gone, or its loop starved) is probed every tick with a `ping` on its control subject:

- NATS answers "no responders" at once when nobody subscribes there: the process or its connection is
  gone (a killed process's socket closes; a lost host's is dropped by the server's own pings). Its
  requests move to a live worker (migration.py), or end with a clean 503.
- A reply means it lives: nothing happens, whatever its silence. A new instance id in the reply (or in a
  report) means it restarted under the same id, and the requests sent to the old process are lost.
- No answer within the probe timeout means it is busy or wedged: its requests stay. Only a worker that
  stays silent and unanswering for `worker_dead_after` seconds (counted from when this gateway's own
  NATS connection last came back) is given up, and its requests are aborted there before they move.

Requests: one with no output after `first_output_timeout` whose worker has published no step since is
a 504 (aborted on the worker); if the worker is making progress, it is asked whether it holds the
request (queue time is not silence), and a request it does not hold was lost on the way (504). A
request past its own `timeout` is aborted and ends with a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import nats.errors

from services.gateway.config import GatewayConfig
from services.gateway.errors import GATEWAY_TIMEOUT
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import WorkerRegistry
from services.gateway.streams import RequestStream, StreamHub
from shared.bus import Bus
from shared.protocol import PROTOCOL_VERSION, ControlReply, ControlRequest

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
# A worker is probed once it has missed this many of its own report intervals (at least PROBE_MIN_S).
PROBE_AFTER_INTERVALS = 1.5
PROBE_MIN_S = 1.0
PROBE_TIMEOUT_S = 1.0


class Owner(Protocol):
    """What the watchdog asks of the dispatcher."""

    def worker_lost(self, worker_id: str, reason: str, instance: str | None = None, abort: bool = False) -> None: ...

    def give_up(self, stream: RequestStream, status: int, message: str) -> None: ...

    async def control(self, worker_id: str, command: str, rid: str | None = None) -> ControlReply: ...


class Watchdog:
    """Ticks every WATCH_INTERVAL_S: probes silent workers, gives up on wedged ones, times requests out."""

    def __init__(
        self, bus: Bus, config: GatewayConfig, registry: WorkerRegistry, hub: StreamHub, metrics: GatewayMetrics,
        owner: Owner,
    ) -> None:
        self.bus = bus
        self.config = config
        self.registry = registry
        self.hub = hub
        self.metrics = metrics
        self.owner = owner
        self._probing: set[str] = set()
        self._checking: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._connected_since = time.monotonic()
        self._was_connected = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gateway-watchdog")

    async def stop(self) -> None:
        for task in [self._task, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one bad tick
                logger.exception("gateway watchdog tick failed")

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        connected = self.bus.nc.is_connected
        if connected and not self._was_connected:
            self._connected_since = now  # silence while this gateway was cut off says nothing of workers
        self._was_connected = connected
        if connected:
            self._check_workers(now)
            self._check_requests(now)
        for stream in self.hub.expired(now):
            self.owner.give_up(stream, GATEWAY_TIMEOUT, f"request {stream.rid} timed out (its `timeout`)")
        self.metrics.set_live_workers([w.load.model for w in self.registry.live()])

    # ---- workers ---------------------------------------------------------------------------------

    def _check_workers(self, now: float) -> None:
        for worker_id in self.registry.prune_dead(now, since=self._connected_since):
            self.owner.worker_lost(
                worker_id,
                f"worker {worker_id} stopped responding (no report or answer for {self.config.worker_dead_after:g} s)",
                abort=True,
            )
        for entry in self.registry.all():
            wid = entry.load.worker_id
            after = max(PROBE_MIN_S, PROBE_AFTER_INTERVALS * entry.load.interval)
            if now - max(entry.last_seen, self._connected_since) > after and wid not in self._probing:
                self._probing.add(wid)
                self._spawn(self._probe(wid, entry.load.instance))

    async def _probe(self, worker_id: str, instance: str) -> None:
        try:
            reply = await self.bus.request(
                self.bus.subjects.worker_control(worker_id),
                ControlRequest(v=PROTOCOL_VERSION, command="ping"), (ControlReply,), timeout=PROBE_TIMEOUT_S,
            )
        except nats.errors.NoRespondersError:
            entry = self.registry.get(worker_id)
            if entry is not None and entry.load.instance == instance:
                self.owner.worker_lost(worker_id, f"worker {worker_id} is gone (its NATS connection closed)")
            return
        except (asyncio.TimeoutError, nats.errors.Error):
            return  # busy, wedged, or NATS itself unreachable: the silence bound decides
        finally:
            self._probing.discard(worker_id)
        entry = self.registry.get(worker_id)
        if entry is None:
            return
        if reply.message and instance and reply.message != instance:
            self.owner.worker_lost(worker_id, f"worker {worker_id} restarted", instance=instance)
        else:
            entry.answered_at = time.monotonic()

    # ---- requests --------------------------------------------------------------------------------

    def _check_requests(self, now: float) -> None:
        timeout = self.config.first_output_timeout
        for stream in self.hub.silent(timeout, now):
            progress = self.registry.progress_at(stream.worker_id)
            if progress is None or now - progress > timeout:
                self.owner.give_up(stream, GATEWAY_TIMEOUT, f"no output for request {stream.rid} after {timeout:.0f} s")
            elif stream.rid not in self._checking:
                self._checking.add(stream.rid)
                self._spawn(self._check_held(stream, timeout))

    async def _check_held(self, stream: RequestStream, timeout: float) -> None:
        """The worker is making progress but this request has had no output: queued there (keep it),
        or lost on the way (504)."""
        try:
            reply = await self.owner.control(stream.worker_id, "status", stream.rid)
        finally:
            self._checking.discard(stream.rid)
        if stream.finished or stream.first_output_at is not None:
            return
        if reply.ok:
            stream.checked_at = time.monotonic()
        elif reply.message and "not in flight" in reply.message:
            self.owner.give_up(
                stream, GATEWAY_TIMEOUT,
                f"no output for request {stream.rid} after {timeout:.0f} s: worker {stream.worker_id} does not hold it",
            )
        else:
            stream.checked_at = time.monotonic()  # no answer (busy worker): ask again after another timeout

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
