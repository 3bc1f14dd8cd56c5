# Over 400 lines: every handler here shares the flight table, the scheduler client and the bus of one NATS service.
"""The worker service: the scheduler (through SchedulerClient) behind NATS. Rank 0's process alone talks
to NATS; with tp_size > 1 the ranks are its child processes (with nnodes > 1, this node's; the other
nodes run `radixserve worker --node-rank N`, rank_processes.serve_node, with no NATS).

    {p}.worker.{wid}.requests  in   GenerateRequest -> a Req (validated, seeded) on the scheduler
    {p}.worker.{wid}.control   in   ControlRequest abort | flush_cache | get_info -> ControlReply
    {p}.detok.{wid}            out  a BatchTokenOut per scheduler step (every request it advanced that
                                    has something to send), steps that queued meanwhile as one
    {p}.gateway.{gid}.stream   out  error finals for requests refused here; with --with-detokenizer,
                                    every stream message (the detokenizer runs in this process)
    {p}.workers.load           out  WorkerLoad every load_interval seconds: the heartbeat, sent by the
                                    event loop with the scheduler's latest figures, never waiting for it

Which tokens go out in which message (every step for a streamed request; the first token and the final
for one whose client wants the whole answer) is services/worker/frontend/output_batcher.py's. A scheduler thread
computing on the CPU starts no step until the loop has written the message of a step that gave some
request its first token (at most FIRST_TOKEN_WAIT_S): its compute threads would otherwise hold every
core, and it the GIL, while that token is on its way to the client. A scheduler process there does the
same through its inbox (HandOverFirstTokens, then a FirstTokensOut once such a step's message is written). A worker refuses to start under an id that a live worker of its namespace serves (its control subject
has a responder). An abort for a request not (yet) here is remembered for a minute: a request whose abort
overtook it (the client left while it was at the tokenizer) ends with an 'abort' final on arrival. On SIGTERM the worker sends a last WorkerLoad marked draining (gateways stop routing to it at once), refuses new
requests with an error final, gives running ones drain_timeout seconds, ends the rest (with an 'error' final
that says the worker shut down) and drains NATS.

Metrics: frontend/metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.worker.frontend.metrics import WorkerMetrics
from services.worker.frontend.output_batcher import Flight, OutputBatcher
from services.worker.frontend.scheduler_client import SchedulerClient
from services.worker.frontend.service_config import WorkerServiceConfig
from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import FinishReason, Req
from shared import trace
from shared.bus import Bus, PayloadTooLarge
from shared.metrics import MetricsServer, start_metrics_server
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    WorkerInfo,
    WorkerLoad,
)
from shared.service import Service, connect_bus, drain_bus, is_subject_token, publish_error

logger = logging.getLogger(__name__)

INFO_TIMEOUT_S = 30.0
# After drain_timeout, the requests cut get this long to publish their 'error' finals.
ABORT_GRACE_S = 5.0
# An abort can overtake its request (still at the tokenizer); it is remembered this long, this many.
EARLY_ABORT_TTL_S = 60.0
EARLY_ABORT_MAX = 10_000
# A scheduler thread computing on the CPU waits up to this long, after a step that gave a request its
# first token, for the event loop to write that step's message before it starts the next step: its
# compute threads would otherwise hold every core (and it the GIL) while the token is on its way out.
FIRST_TOKEN_WAIT_S = 0.005
# How long a starting worker waits for a live worker already holding its id to answer.
CLAIM_TIMEOUT_S = 2.0


def _log_refresh_failure(task: asyncio.Task[WorkerInfo]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("the scheduler's figures were not refreshed: %s", task.exception())


class StepSink(Protocol):
    """Where the worker hands each step's outputs when it detokenizes in its own process
    (--with-detokenizer): the detokenizer service's StreamPublisher, given to the worker by whoever
    composes the two (services/cli.py), so the worker's package does not import the detokenizer's."""

    async def handle(self, batch: BatchTokenOut) -> None: ...


StepSinkFactory = Callable[[Bus, Any], StepSink]  # (bus, the model's tokenizer) -> a StepSink


class WorkerService(Service):
    """One worker: a model on one device (or one TP group) serving requests from NATS."""

    name = "worker"

    def __init__(self, config: WorkerServiceConfig, detokenizer: StepSinkFactory | None = None) -> None:
        super().__init__()
        if config.with_detokenizer and detokenizer is None:
            raise ValueError("--with-detokenizer: this worker was built without a detokenizer to run in its process")
        self.config = config
        self.worker_id = config.worker_id
        self.bus: Bus | None = None
        self.client: SchedulerClient | None = None
        self._make_stream = detokenizer
        self.stream: StepSink | None = None
        self.metrics = WorkerMetrics(config.model_name, config.engine.speculative_num_draft_tokens)
        self.batcher = OutputBatcher(self.worker_id, self.metrics)
        # This process's id: a worker restarted under the same worker id has a new one, so gateways
        # know the requests they sent to the old process are lost.
        self.instance = uuid.uuid4().hex[:12]
        self._info_cache: WorkerInfo | None = None
        self._flights = self.batcher.flights
        self._early_aborts: dict[str, float] = {}  # rid -> when its abort came, oldest first
        self._draining = False
        self._steps: asyncio.Queue[list[ReqOutput] | None] = asyncio.Queue()
        self._step_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._loop_thread = -1  # the event loop thread's id, once started
        self._metrics_server: MetricsServer | None = None
        # Set in start(): a scheduler thread computing on the CPU waits for first tokens to go out; a
        # scheduler process there waits for the FirstTokensOut this loop sends (_first_out: one is due).
        self._await_first_tokens = False
        self._ack_first_tokens = False
        self._first_out = False
        self._handed_off: list[threading.Event] = []  # set once their step's message is written
        self._requests_sub: Subscription | None = None
        # Requests of one NATS delivery, handed to the scheduler together (_admit).
        self._arrived: list[Req] = []

    # ---- life cycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self.bus = await connect_bus(cfg, f"worker-{self.worker_id}")
        await self._claim_id()
        engine = cfg.engine
        logger.info("worker %s loading %s (tp_size %d%s over %d node(s)%s)", self.worker_id, engine.model_path,
                    engine.tp_size, f" x pp_size {engine.pp_size}" if engine.pp_size > 1 else "", engine.nnodes,
                    f"; this is node 0, the others join at {engine.dist_init_addr}" if engine.nnodes > 1 else "")
        self._loop_thread = threading.get_ident()
        # A scheduler thread hands its outputs over itself (outputs_inline); a scheduler process's
        # outbox is read on this loop (outputs_loop). Either way no dispatcher thread wakes in between.
        self.client = await asyncio.to_thread(
            SchedulerClient, cfg.engine, self._outputs_from_thread, self._failure_from_thread, outputs_inline=True,
            outputs_loop=self._loop,
        )
        on_cpu = self.client.server_info["device"].startswith("cpu")
        self._await_first_tokens = not cfg.engine.scheduler_in_process() and on_cpu
        self._ack_first_tokens = cfg.engine.scheduler_in_process() and on_cpu and cfg.engine.world_size() == 1
        if self._ack_first_tokens:
            self.client.hand_over_first_tokens()
        if cfg.with_detokenizer:
            if self.client.tokenizer is None:
                raise ValueError("--with-detokenizer needs a tokenizer; this checkpoint has none")
            assert self._make_stream is not None  # checked in __init__
            self.stream = self._make_stream(self.bus, self.client.tokenizer)
        subjects = self.bus.subjects
        self._info_cache = await self._info()
        self._step_task = asyncio.create_task(self._publish_steps())
        self._requests_sub = await self.bus.subscribe(
            subjects.worker_requests(self.worker_id), (GenerateRequest,), self._on_generate
        )
        await self.bus.subscribe(subjects.worker_control(self.worker_id), (ControlRequest,), self._on_control)
        self._load_task = asyncio.create_task(self._publish_load())
        self._metrics_server = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
        logger.info(
            "worker %s serves %s on %s (outputs to %s; the scheduler's outputs reach the event loop from %s)",
            self.worker_id, cfg.model_name, subjects.worker_requests(self.worker_id),
            "gateways directly" if self.stream else subjects.detok(self.worker_id),
            "its process's pipe" if cfg.engine.scheduler_in_process() else "its thread",
        )
        if self._await_first_tokens:
            logger.info("worker %s: the scheduler thread starts no step before a first token is written", self.worker_id)

    async def drain(self) -> None:
        """Refuse new work, let running requests finish (bounded), abort the rest, drain NATS."""
        self._draining = True
        if self._load_task is not None:
            self._load_task.cancel()
            await self._announce_draining()
        if self.client is not None:
            if self._flights:
                logger.info("waiting up to %.0f s for %d request(s)", self.config.drain_timeout, len(self._flights))
            if not await self._wait_for_flights(self.config.drain_timeout):
                logger.warning("aborting %d request(s) still running", len(self._flights))
                cut = FinishReason("error", message=(
                    f"worker {self.worker_id} shut down: the request was still running when its "
                    f"{self.config.drain_timeout:g} s drain timeout ended"), status=503)
                self._admit_now()  # an abort must not overtake its request
                for rid in list(self._flights):
                    self.client.abort(rid, cut)
                await self._wait_for_flights(ABORT_GRACE_S)
        self._steps.put_nowait(None)  # the step publisher sends what is queued, then stops
        for task in (self._step_task, self._load_task):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                    await asyncio.wait_for(task, timeout=ABORT_GRACE_S)
        await drain_bus(self.bus, 10.0)
        if self.client is not None:
            await asyncio.to_thread(self.client.shutdown)
        if self._metrics_server is not None:
            self._metrics_server.stop()

    async def _announce_draining(self) -> None:
        """One last WorkerLoad saying so: gateways stop routing here at once (its requests go on)."""
        assert self.bus is not None and self._info_cache is not None
        load = self._load(self._info_cache)
        load.draining = True
        try:
            await self.bus.publish(self.bus.subjects.workers_load, load)
        except Exception as exc:  # noqa: BLE001 - NATS down: gateways stop routing here after the TTL
            logger.warning("worker %s: could not announce draining: %s", self.worker_id, exc)

    def _load(self, info: WorkerInfo) -> WorkerLoad:
        return WorkerLoad(
            v=PROTOCOL_VERSION, worker_id=self.worker_id, model=info.model,
            num_running=info.num_running, num_waiting=info.num_waiting,
            kv_usage=info.kv_in_use / max(1, info.max_total_tokens), cache_hit_rate=info.cache_hit_rate,
            max_total_tokens=info.max_total_tokens, context_len=info.context_len, timestamp=time.time(),
            instance=self.instance, steps=self.batcher.step, interval=self.config.load_interval,
        )

    async def _wait_for_flights(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._flights

    # ---- scheduler -> NATS ----------------------------------------------------------------------

    def _outputs_from_thread(self, outputs: list[ReqOutput]) -> None:
        """Called on the scheduler's thread, or on this loop's (a scheduler process's outbox is read
        here): hand the step to the step publisher, in order."""
        trace.mark_each(outputs, "worker.outputs")
        if threading.get_ident() == self._loop_thread:
            self.bus.poller.touch()
            self._first_out = self._first_out or (self._ack_first_tokens and self._has_first_output(outputs))
            self._steps.put_nowait(outputs)
            return
        handed_off = threading.Event() if self._await_first_tokens and self._has_first_output(outputs) else None
        with contextlib.suppress(RuntimeError):  # the loop is gone: the process is exiting
            self._loop.call_soon_threadsafe(self._take_step, outputs, handed_off)
        if handed_off is not None:
            # A request's first token goes out before the next step takes the cores (FIRST_TOKEN_WAIT_S).
            handed_off.wait(FIRST_TOKEN_WAIT_S)

    def _has_first_output(self, outputs: list[ReqOutput]) -> bool:
        """Whether a request among `outputs` has sent nothing yet (read on the scheduler's thread: a
        flight that changes meanwhile makes one step wait, or not, once)."""
        flights = self._flights
        return any((flight := flights.get(out.rid)) is not None and flight.first for out in outputs)

    def _take_step(self, outputs: list[ReqOutput], handed_off: threading.Event | None) -> None:
        self._steps.put_nowait(outputs)
        if handed_off is not None:
            self._handed_off.append(handed_off)

    def _failure_from_thread(self, message: str) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._scheduler_failed(message)))

    async def _scheduler_failed(self, message: str) -> None:
        logger.error("worker %s: the scheduler failed: %s", self.worker_id, message)
        flights = dict(self._flights)
        self._flights.clear()
        for rid, flight in flights.items():
            await self._refuse(flight.gateway_id, rid, f"worker {self.worker_id} failed: {message.splitlines()[0]}", 500)
        self.stop(1)

    async def _publish_steps(self) -> None:
        """Publish the steps in order until the None that drain() queues; the steps that queued while
        a message went out are one round, one message (output_batcher.py)."""
        while True:
            steps, stopping = await self._next_round()
            handed_off, self._handed_off = self._handed_off, []  # the waits of exactly these steps
            first_out, self._first_out = self._first_out, False  # set before such a step was queued
            batch = self.batcher.batch(steps)
            if batch.items:
                try:
                    await self._send(batch)
                except Exception:  # noqa: BLE001 - a lost step must not stop the next ones
                    logger.exception("worker %s: could not publish step %d", self.worker_id, batch.step)
                trace.mark_each(batch.items, "worker.published")
            if handed_off or first_out:
                await asyncio.sleep(0)  # the NATS client's flusher writes the message to the socket
                for event in handed_off:
                    event.set()
                if first_out:
                    self.client.first_tokens_out()
            if stopping:
                return
            await asyncio.sleep(0)  # arrivals and controls go before the next round

    async def _next_round(self) -> tuple[list[list[ReqOutput]], bool]:
        """The next step (waiting for one) and every step queued behind it; True once None came."""
        steps: list[list[ReqOutput]] = []
        item = await self._steps.get()
        while item is not None:
            steps.append(item)
            if self._steps.empty():
                return steps, False
            item = self._steps.get_nowait()
        return steps, True

    async def _send(self, batch: BatchTokenOut) -> None:
        assert self.bus is not None
        if self.stream is not None:
            await self.stream.handle(batch)
            return
        subject = self.bus.subjects.detok(self.worker_id)
        try:
            await self.bus.publish(subject, batch)
        except PayloadTooLarge:
            # Many requests with many top logprobs: send the step one request at a time.
            for item in batch.items:
                await self.bus.publish(subject, BatchTokenOut(v=batch.v, worker_id=batch.worker_id, step=batch.step, items=[item]))

    async def _claim_id(self) -> None:
        """Refuse to start under a worker id that a live worker of this namespace already serves: two
        processes on one id would both take its requests. NATS answers "no responders" at once when
        nobody subscribes to the id's control subject; any other outcome (a reply, or a busy worker
        that does not answer in time) means the id is taken."""
        assert self.bus is not None
        subject = self.bus.subjects.worker_control(self.worker_id)
        try:
            await self.bus.request(subject, ControlRequest(v=PROTOCOL_VERSION, command="ping"), (ControlReply,),
                                   timeout=CLAIM_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            return
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            pass
        raise ValueError(
            f"worker id {self.worker_id!r} is already served by a live worker in namespace "
            f"{self.bus.subjects.prefix!r} (it subscribes to {subject}); give this worker another --worker-id"
        )

    async def _publish_load(self) -> None:
        """The worker's heartbeat: a WorkerLoad every load_interval seconds from this event loop, with
        the latest figures the scheduler gave. It never waits for the scheduler (a long step would
        otherwise silence it and gateways would take a busy worker for a dead one); the figures are
        refreshed by a get_info that runs beside it, one at a time."""
        assert self.bus is not None
        refresh: asyncio.Task[WorkerInfo] | None = None
        while True:
            started = time.monotonic()
            if refresh is not None and refresh.done():
                with contextlib.suppress(Exception):  # logged below on the next failure
                    self._info_cache = refresh.result()
                refresh = None
            if refresh is None:
                refresh = asyncio.create_task(self._info())
                refresh.add_done_callback(_log_refresh_failure)
            info = self._info_cache
            assert info is not None  # fetched in start()
            try:
                await self.bus.publish(self.bus.subjects.workers_load, self._load(info))
            except asyncio.CancelledError:
                refresh.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - NATS down: try next period
                logger.warning("worker %s: no WorkerLoad this period: %s", self.worker_id, exc)
            try:
                await asyncio.sleep(max(0.0, self.config.load_interval - (time.monotonic() - started)))
            except asyncio.CancelledError:
                refresh.cancel()
                raise

    async def _info(self) -> WorkerInfo:
        assert self.client is not None
        raw = await asyncio.to_thread(self.client.control, "get_info", INFO_TIMEOUT_S)
        if raw is None:
            raise RuntimeError("the scheduler has stopped")
        stats = raw["stats"]
        info = WorkerInfo(
            worker_id=self.worker_id,
            model=self.config.model_name,
            max_total_tokens=raw["max_total_tokens"],
            max_running_requests=raw["max_running_requests"],
            context_len=self.client.model_config.context_len,
            num_running=raw["num_running"],
            num_waiting=raw["num_waiting"],
            kv_free=raw["kv_free"],
            kv_cached=raw["kv_cached"],
            kv_in_use=raw["kv_in_use"],
            cache_hit_rate=stats["cached_tokens"] / max(1, stats["prompt_tokens"]),
            generated_tokens=stats["generated_tokens"],
            tp_size=self.config.engine.tp_size,
            device=raw["device"],
            pp_size=self.config.engine.pp_size,
            nnodes=self.config.engine.nnodes,
        )
        self.metrics.observe_info(raw, time.monotonic())
        return info

    # ---- NATS -> scheduler ----------------------------------------------------------------------

    async def _refuse(
        self, gateway_id: str, rid: str, message: str, status: int | None = None, param: str | None = None,
    ) -> None:
        assert self.bus is not None
        self.metrics.count_request("error")
        await publish_error(self.bus, gateway_id, rid, message, status, param)

    async def _on_generate(self, msg: GenerateRequest, raw: Msg) -> None:
        assert self.client is not None
        trace.mark(msg.rid, "worker.received")
        if not is_subject_token(msg.gateway_id):
            logger.warning("worker %s dropped request %s: gateway_id %r is not a subject token", self.worker_id, msg.rid, msg.gateway_id)
            return
        if self._draining:
            await self._refuse(msg.gateway_id, msg.rid, f"worker {self.worker_id} is shutting down", 503)
            return
        if msg.rid in self._flights:
            await self._refuse(msg.gateway_id, msg.rid, f"request id {msg.rid!r} is already in flight")
            return
        try:
            (req,) = self.client.build_reqs(
                msg.input_ids, msg.sampling.to_dict(), rid=msg.rid, return_logprob=msg.return_logprob,
                top_logprobs_num=msg.top_logprobs_num, priority=msg.priority, resume_ids=msg.resume_ids,
                # A migrated request's client has had its prompt log-probs from the lost worker.
                logprob_start_len=None if msg.resume_ids else msg.logprob_start_len,
            )
        except ValueError as exc:
            logger.info("worker %s refused request %s: %s", self.worker_id, msg.rid, exc)
            await self._refuse(msg.gateway_id, msg.rid, str(exc), param=getattr(exc, "param", None))
            return
        params = req.sampling_params
        self._flights[req.rid] = Flight(
            msg.gateway_id, params.stop_strings(), params.skip_special_tokens, msg.stream,
            resume_ids=msg.resume_ids or None, resume_chars=msg.resume_chars,
        )
        self.metrics.prompt_tokens.inc(len(msg.input_ids))
        if self._early_aborts.pop(req.rid, None) is not None:
            self._finish_unscheduled(req.rid, FinishReason("abort", message="aborted by request"), len(msg.input_ids))
        elif req.remaining_new_tokens() == 0 and req.logprob_start_len is None:
            # max_new_tokens 0 (without prompt log-probs to compute), or a migrated request already done
            self._finish_unscheduled(
                req.rid, FinishReason("length", params.max_new_tokens), len(msg.input_ids), len(req.output_ids)
            )
        else:
            self._arrived.append(req)
        self._admit()

    def _admit(self) -> None:
        """Hand the requests received so far to the scheduler as one command once this delivery's
        last message has been read: requests that reached the worker together (the messages of one
        read from the NATS socket wait in the subscription's queue) are admitted before the same
        step, instead of the first one being prefilled alone while the others are still being read.
        A lone request goes at once; should a handler suspend, or the rest of a delivery be dropped
        as malformed, the call_soon hands over what has come by the next turn of the loop."""
        if not self._arrived:
            return
        sub = self._requests_sub
        if sub is not None and sub.pending_msgs > 0:
            if len(self._arrived) == 1:
                self._loop.call_soon(self._admit_now)
            return
        self._admit_now()

    def _admit_now(self) -> None:
        arrived, self._arrived = self._arrived, []
        if not arrived or self.client is None:
            return
        self.client.add(*arrived)
        trace.mark_each(arrived, "worker.queued")

    def _finish_unscheduled(self, rid: str, reason: FinishReason, prompt_tokens: int, completion_tokens: int = 0) -> None:
        """A request that ends before the scheduler sees it: its final goes out as a step of its own."""
        self._steps.put_nowait([ReqOutput(
            rid, [], finished_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        )])

    def _remember_early_abort(self, rid: str) -> None:
        now = time.monotonic()
        self._early_aborts[rid] = now
        while self._early_aborts and (
            len(self._early_aborts) > EARLY_ABORT_MAX or now - next(iter(self._early_aborts.values())) > EARLY_ABORT_TTL_S
        ):
            del self._early_aborts[next(iter(self._early_aborts))]

    async def _on_control(self, msg: ControlRequest, raw: Msg) -> None:
        assert self.bus is not None
        try:
            reply = await self._control(msg)
        except (queue.Empty, RuntimeError) as exc:
            reply = self._reply(False, f"the scheduler did not answer: {exc or 'timeout'}")
        await self.bus.respond(raw, reply)

    async def _control(self, msg: ControlRequest) -> ControlReply:
        assert self.client is not None
        if msg.command == "abort":
            if not msg.rid:
                return self._reply(False, "abort needs `rid`")
            if msg.rid not in self._flights:
                self._remember_early_abort(msg.rid)
                return self._reply(
                    False,
                    f"request {msg.rid!r} is not in flight on worker {self.worker_id}; "
                    "if it arrives within a minute it ends at once",
                )
            self._admit_now()  # an abort must not overtake its request
            self.client.abort(msg.rid)
            return self._reply(True)
        if msg.command == "flush_cache":
            if await asyncio.to_thread(self.client.control, "flush_cache", INFO_TIMEOUT_S):
                return self._reply(True)
            return self._reply(False, "requests are in flight; the cache was not flushed")
        if msg.command == "get_info":
            return ControlReply(v=PROTOCOL_VERSION, ok=True, info=await self._info())
        if msg.command == "ping":
            return self._reply(True, self.instance)
        if msg.command == "status":
            if msg.rid in self._flights:
                return self._reply(True)
            return self._reply(False, f"request {msg.rid!r} is not in flight on worker {self.worker_id}")
        return self._reply(False, f"unknown command {msg.command!r}; expected abort, flush_cache, get_info, ping or status")

    @staticmethod
    def _reply(ok: bool, message: str | None = None) -> ControlReply:
        return ControlReply(v=PROTOCOL_VERSION, ok=ok, message=message)
