"""The Dispatcher: what every front door (HTTP, gRPC, NATS) does with a request.

validate -> choose a worker (router) -> register the stream (streams) -> publish a TokenizeRequest to
`{p}.tokenize` (or, with --local-tokenizer for the worker's model, tokenize here and publish the
GenerateRequest straight to the worker; with --local-tokenizer-max-chars, only prompts up to that
size) -> the front door reads the stream. A prompt given as token ids
has nothing to tokenize: its GenerateRequest goes straight to the worker, which checks the ids against
its model (the tokenizer service would have made the same checks) and refuses bad ones with the same
error final. A client that goes away releases its request, which
aborts it on its worker (freeing its KV). The watchdog (liveness.py) tells gone workers from busy
ones; a gone worker's requests migrate to live workers (migration.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from pathlib import PurePath
from typing import Any

import nats.errors

from services.gateway.aborts import Aborts
from services.gateway.auth import ApiKey, KeyStore, StoreUnavailable, current_key
from services.gateway.completion import Completion, collect
from services.gateway.config import GatewayConfig
from services.gateway.errors import (
    BAD_REQUEST,
    NOT_FOUND,
    PAYLOAD_TOO_LARGE,
    SERVICE_UNAVAILABLE,
    GatewayError,
    bad_request,
    pipeline_error,
)
from services.gateway.generate_spec import GenerateSpec, field_of
from services.gateway.liveness import Watchdog
from services.gateway.metrics import GatewayMetrics, note_model
from services.gateway.migration import Migrations
from services.gateway.prefix_index import routing_key
from services.gateway.router import WorkerEntry, WorkerRegistry, model_matches
from services.gateway.streams import RequestStream, StreamHub
from shared import trace
from shared.bus import Bus, PayloadTooLarge
from shared.model_path import resolve_model_path
from shared.prompt_tokenizer import (
    PromptTokenizer,
    generate_request,
    is_quick,
)
from shared.protocol import (
    PROTOCOL_VERSION,
    ControlReply,
    ControlRequest,
    StreamOut,
    TextTokenize,
    TextTokenized,
    TokenizeRequest,
    Usage,
    WorkerLoad,
)

logger = logging.getLogger(__name__)


class Dispatcher:
    """Routes requests to workers over NATS and follows their streams."""

    def __init__(self, bus: Bus, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.registry = WorkerRegistry(
            config.worker_ttl,
            config.worker_dead_after,
            policy=config.routing_policy,
            cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
        )
        self.hub = StreamHub(bus, config.gateway_id, metrics)
        self.local_tokenizer: PromptTokenizer | None = None
        self.keys = KeyStore.from_config(config)
        self.aborts = Aborts(self)  # aborts on behalf of a key: scope rules and other replicas
        self.hub.on_usage = self._record_usage
        self._tasks: set[asyncio.Task[Any]] = set()
        self._verifying: set[str] = set()  # worker ids whose report of a new instance is being checked
        self.migrations = Migrations(config, self.registry, self.hub, metrics, publish=self._publish,
                                     send_abort=self._send_abort, spawn=self._spawn)
        self.watchdog = Watchdog(bus, config, self.registry, self.hub, metrics, self)

    @property
    def gateway_id(self) -> str:
        return self.config.gateway_id

    async def start(self) -> None:
        await self.keys.check()
        if self.config.local_tokenizer:
            path = str(resolve_model_path(self.config.local_tokenizer))
            self.local_tokenizer = await asyncio.to_thread(
                PromptTokenizer.load, path, None, self.config.tokenizer_path, self.config.chat_template
            )
            limit = self.config.local_tokenizer_max_chars
            logger.info("gateway %s tokenizes prompts for %s itself%s", self.gateway_id, PurePath(path).name,
                        "" if limit is None else f" up to {limit} characters (longer ones: the tokenizer service)")
        await self.hub.start()
        await self.aborts.start()
        await self.bus.subscribe(self.bus.subjects.workers_load, (WorkerLoad,), self._on_load)
        self.watchdog.start()

    async def stop(self) -> None:
        await self.watchdog.stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.control_timeout)
        await self.keys.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every in-flight request to end; True if they did."""
        deadline = time.monotonic() + timeout
        while len(self.hub) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not len(self.hub)

    # ---- requests -------------------------------------------------------------------------------

    async def submit(self, spec: GenerateSpec) -> RequestStream:
        """Validate, route and publish one request; its outputs arrive on the returned stream."""
        spec.validate()
        return await self._submit_valid(spec)

    async def _submit_valid(self, spec: GenerateSpec) -> RequestStream:
        note_model(spec.model)  # counted under the model it named, even when none serves it
        worker = await self._choose(spec.model, routing_key(spec.text, spec.messages, spec.input_ids))
        note_model(worker.load.model)
        rid = spec.rid or uuid.uuid4().hex
        trace.mark(rid, "gateway.submit")
        stream = self.hub.open(rid, worker.load.worker_id, worker.load.model)
        stream.api_key = current_key.get()
        stream.prompt_param = spec.prompt_field()
        stream.instance, stream.model = worker.load.instance, spec.model
        if spec.timeout is not None:
            stream.deadline = stream.started + spec.timeout
        msg = TokenizeRequest(
            v=PROTOCOL_VERSION,
            rid=rid,
            gateway_id=self.gateway_id,
            worker_id=worker.load.worker_id,
            sampling=spec.sampling,
            text=spec.text,
            messages=spec.messages,
            input_ids=spec.input_ids,
            add_generation_prompt=spec.add_generation_prompt,
            chat_template_kwargs=spec.chat_template_kwargs or None,
            tools=spec.tools or None,
            return_logprob=spec.return_logprob or spec.top_logprobs_num > 0,
            top_logprobs_num=spec.top_logprobs_num,
            logprob_start_len=spec.logprob_start_len if spec.return_logprob or spec.top_logprobs_num > 0 else None,
            stream=spec.stream,
        )
        stream.request = msg
        try:
            await self._publish(stream, msg, worker)
        except PayloadTooLarge as exc:
            self.hub.close(stream)
            raise GatewayError(PAYLOAD_TOO_LARGE, f"the request is too large: {exc}") from None
        except ValueError as exc:  # the local tokenizer's refusal
            self.hub.close(stream)
            raise pipeline_error(BAD_REQUEST, str(exc), getattr(exc, "param", None) or field_of(str(exc)),
                                 stream.prompt_param) from None
        except Exception:
            self.hub.close(stream)
            raise
        trace.mark(rid, "gateway.published")
        return stream

    async def _publish(self, stream: RequestStream, msg: TokenizeRequest, worker: WorkerEntry) -> None:
        """Send a request on its way to `worker`: tokenized here, straight to the worker (token ids),
        or through the tokenizer service."""
        if self.tokenizes_for(worker) and self.tokenizes_here(msg):
            await self._publish_tokenized(msg)
        elif msg.input_ids is not None:
            # One NATS hop and one process fewer on the way to the first token.
            out = generate_request(msg, msg.input_ids)
            await self.bus.publish(self.bus.subjects.worker_requests(msg.worker_id), out)
        else:
            await self.bus.publish(self.bus.subjects.tokenize, msg, reply=self.hub.reply_subject(stream))

    def tokenizes_for(self, worker: WorkerEntry) -> bool:
        """Whether this gateway tokenizes requests for `worker` itself (its --local-tokenizer model is
        the one the worker serves)."""
        name = self.config.served_model_name or PurePath(self.config.local_tokenizer).name
        return self.local_tokenizer is not None and model_matches(name, worker.load.model)

    def tokenizes_here(self, msg: TokenizeRequest) -> bool:
        """Whether a request for a model this gateway tokenizes is short enough to tokenize here (below
        --local-tokenizer-max-chars): a short prompt costs less to encode than the hop to the tokenizer
        service and back through NATS (~0.5 ms here, ~0.8 ms on the GPU host: bench/pipeline_hops.py)."""
        limit = self.config.local_tokenizer_max_chars
        return limit is None or is_quick(msg, limit)

    async def _publish_tokenized(self, msg: TokenizeRequest) -> None:
        """What the tokenizer service would do, here: ids (or ValueError naming the field) straight to
        the worker. Short prompts are encoded on the event loop (a thread hand-off costs more than
        they do); long ones in a thread, so other requests keep flowing."""
        assert self.local_tokenizer is not None
        if is_quick(msg):
            out = self.local_tokenizer.to_generate(msg)
        else:
            out = await asyncio.to_thread(self.local_tokenizer.to_generate, msg)
        await self.bus.publish(self.bus.subjects.worker_requests(msg.worker_id), out)

    async def tokenize_text(self, model: str | None, msg: TextTokenize) -> TextTokenized:
        """/tokenize and /detokenize: this gateway's own tokenizer when it has the model's, else the
        tokenizer service (request/reply); 404 for a model no live worker serves, 503 when no tokenizer
        answers, 400 with the tokenizer's message for a bad request."""
        worker = await self._choose(model)
        if self.tokenizes_for(worker):
            assert self.local_tokenizer is not None
            answer = await asyncio.to_thread(self.local_tokenizer.answer, msg)
        else:
            try:
                answer = await self.bus.request(
                    self.bus.subjects.tokenize_text, msg, (TextTokenized,), timeout=self.config.control_timeout
                )
            except PayloadTooLarge as exc:
                raise GatewayError(PAYLOAD_TOO_LARGE, f"the request is too large: {exc}") from None
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                raise GatewayError(
                    SERVICE_UNAVAILABLE,
                    f"no tokenizer answered on {self.bus.subjects.tokenize_text} within {self.config.control_timeout:g} s",
                ) from None
        if answer.error is not None:
            raise bad_request(answer.error, "tokens" if msg.input_ids is not None else None)
        return answer

    async def submit_all(self, specs: list[GenerateSpec]) -> list[RequestStream]:
        """Submit several requests (n > 1, batches); if one fails, the others are released."""
        for spec in specs:
            spec.validate()
        streams: list[RequestStream] = []
        try:
            for spec in specs:
                streams.append(await self._submit_valid(spec))
        except BaseException:
            for stream in streams:
                self.release(stream)
            raise
        return streams

    async def collect_all(self, streams: list[RequestStream]) -> list[Completion]:
        """Read every stream to its final; on an error (or cancellation) the rest are released."""
        tasks = [asyncio.create_task(collect(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task, stream in zip(tasks, streams):
                task.cancel()
                self.release(stream)
            raise

    def context_len(self, model: str | None) -> int | None:
        """The longest context among live workers serving `model` (None when there are none)."""
        lens = [w.load.context_len for w in self.registry.live(model)]
        return max(lens) if lens else None

    def served_model(self, stream: RequestStream) -> str:
        """The model name of the worker a request went to."""
        entry = self.registry.get(stream.worker_id)
        return entry.load.model if entry is not None else ""

    async def _choose(self, model: str | None, key: bytes | None = None) -> WorkerEntry:
        if not self.registry.live():
            await self.registry.wait_for_worker(self.config.wait_for_worker)
        if not self.registry.live():
            raise GatewayError(
                SERVICE_UNAVAILABLE,
                f"no live worker: none has reported on {self.bus.subjects.workers_load} "
                f"in the last {self.config.worker_ttl:g} s",
            )
        worker = self.registry.choose(model, self.hub.per_worker(), key=key)
        if worker is None:
            raise GatewayError(
                NOT_FOUND, f"model {model!r} is not served here; available: {self.registry.models()}", "model"
            )
        return worker

    def release(self, stream: RequestStream) -> None:
        """The client is done with this request: forget it, and abort it if it has not finished.
        Never awaits, so it is safe in `finally` blocks of cancelled tasks."""
        self.hub.close(stream)
        if not stream.finished:
            stream.finished = True
            self._spawn(self._send_abort(stream.worker_id, stream.rid))

    async def abort(self, rid: str) -> bool:
        """Abort a request by id (from /abort_request, gRPC Abort, NATS abort). A request of this
        gateway keeps its stream, so its client sees the worker's abort final; an id this gateway
        does not know is sent to every live worker (it may belong to another gateway)."""
        stream = self.hub.get(rid)
        if stream is not None:
            stream.abort_asked = True
            await self._send_abort(stream.worker_id, rid)
            return True
        await asyncio.gather(*(self._send_abort(w.load.worker_id, rid) for w in self.registry.live()))
        return False

    async def _send_abort(self, worker_id: str, rid: str) -> None:
        reply = await self.control(worker_id, "abort", rid)
        if not reply.ok:
            logger.info("abort of %s on worker %s: %s", rid, worker_id, reply.message)

    async def control(self, worker_id: str, command: str, rid: str | None = None) -> ControlReply:
        """A control request to one worker; a timeout or transport failure is a not-ok reply."""
        subject = self.bus.subjects.worker_control(worker_id)
        try:
            reply = await self.bus.request(
                subject,
                ControlRequest(v=PROTOCOL_VERSION, command=command, rid=rid),
                (ControlReply,),
                timeout=self.config.control_timeout,
            )
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            return ControlReply(v=PROTOCOL_VERSION, ok=False, message=f"worker {worker_id}: {type(exc).__name__}")
        assert isinstance(reply, ControlReply)
        return reply

    async def control_all(self, command: str) -> dict[str, ControlReply]:
        """The same control request to every live worker, concurrently."""
        workers = [w.load.worker_id for w in self.registry.live()]
        replies = await asyncio.gather(*(self.control(wid, command) for wid in workers))
        if command == "flush_cache":
            for wid, reply in zip(workers, replies):
                if reply.ok:
                    self.registry.prefixes.forget(wid)
        return dict(zip(workers, replies))

    def _record_usage(self, stream: RequestStream, out: StreamOut) -> None:
        """A finished request's tokens count against its API key (Redis keys only)."""
        if stream.api_key is not None and self.keys.redis is not None:
            usage = out.usage or Usage()
            self._spawn(self._usage(stream.api_key, usage.prompt_tokens, usage.completion_tokens))

    async def _usage(self, key: ApiKey, prompt_tokens: int, completion_tokens: int) -> None:
        try:
            await self.keys.record_usage(key, prompt_tokens, completion_tokens)
        except StoreUnavailable as exc:
            logger.warning("usage of key %r not recorded: %s", key.name, exc)

    # ---- background -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_load(self, load: WorkerLoad, raw: object) -> None:
        entry = self.registry.get(load.worker_id)
        if entry is None or entry.load.instance == load.instance:
            self.registry.observe(load)
        elif load.worker_id not in self._verifying:
            self._verifying.add(load.worker_id)
            self._spawn(self._verify_restart(load))

    async def _verify_restart(self, load: WorkerLoad) -> None:
        """A report from another process under a known worker id: a restart only if the process that
        answers on the id's control subject is that one. Otherwise the report is stale, forged, or a
        second process on one id, and the requests of the live process stay where they are."""
        try:
            reply = await self.control(load.worker_id, "ping")
        finally:
            self._verifying.discard(load.worker_id)
        if not (reply.ok and reply.message == load.instance):
            logger.warning("ignored a WorkerLoad for worker %s as instance %r: the worker answers as %r",
                           load.worker_id, load.instance, reply.message)
            return
        old_instance = self.registry.observe(load)
        if old_instance is not None:
            self.worker_lost(load.worker_id, f"worker {load.worker_id} restarted", instance=old_instance)

    # ---- lost workers and requests that stopped (called by the watchdog, liveness.py) ------------

    def worker_lost(self, worker_id: str, reason: str, instance: str | None = None, abort: bool = False) -> None:
        """`worker_id` (or that `instance` of it) is gone: its requests move (migration.py)."""
        self.migrations.worker_lost(worker_id, reason, instance, abort)

    def give_up(self, stream: RequestStream, status: int, message: str) -> None:
        """End a request that took too long with an error, and abort it on its worker."""
        self.migrations.give_up(stream, status, message)
