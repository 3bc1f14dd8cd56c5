"""Per-request stream state: the gateway's one subscription to its stream subject
`{p}.gateway.{gid}.stream`, fanned out to one asyncio queue per in-flight request.

Detokenizers send one BatchStreamOut per scheduler step for all of this gateway's requests that
advanced; the tokenizer sends one with an error final when a request cannot be tokenized. A request
whose worker died, or whose TokenizeRequest found no tokenizer (NATS "no responders" on its reply
subject), gets an error final made here, so no client ever waits on a stream that will not end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from nats.aio.msg import Msg

from services.gateway.auth import ApiKey
from services.gateway.errors import BAD_REQUEST, SERVICE_UNAVAILABLE, bad_request, pipeline_error
from services.gateway.metrics import GatewayMetrics, observe_many
from shared import trace
from shared.bus import Bus
from shared.protocol import BatchStreamOut, Finish, StreamOut, TokenizeRequest, Usage

logger = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


def is_error(out: StreamOut) -> bool:
    return out.finish is not None and out.finish.type == "error"


class RequestStream:
    """One in-flight request's outputs, in arrival order, ending with its final."""

    def __init__(self, rid: str, worker_id: str, reply_token: str, model_name: str = "") -> None:
        self.rid = rid
        self.worker_id = worker_id
        self.model_name = model_name  # the served name of its worker's model: its metrics' label
        self.reply_token = reply_token
        self.started = time.monotonic()
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None
        self.finished = False  # the final (real or made here) has been queued
        self.error_status = BAD_REQUEST  # status of an error final from the pipeline (bad input)
        self.prompt_param = "text"  # the field its client sent the prompt in (GenerateSpec.prompt_field)
        self.api_key: ApiKey | None = None  # the HTTP request's key, when keys are required
        # What migration needs (migration.py): the request as published, the worker process it went to,
        # the model asked for, and what the client has received so far.
        self.request: TokenizeRequest | None = None
        self.instance = ""
        self.model: str | None = None
        self.migrations = 0
        self.abort_asked = False  # a client asked to abort it: it must not move to another worker
        self.delivered_ids: list[int] = []
        self.delivered_chars = 0
        self.deadline: float | None = None  # the request's own `timeout`, as a time.monotonic()
        self.checked_at: float | None = None  # when its worker last said it holds it (no output yet)
        self._queue: asyncio.Queue[StreamOut] = asyncio.Queue()

    def deliver(self, out: StreamOut) -> None:
        if self.finished:
            return
        self.finished = out.finish is not None
        if is_error(out) and out.finish is not None and out.finish.status is not None and 400 <= out.finish.status <= 599:
            self.error_status = out.finish.status  # a worker's 5xx (shutting down, failed); else 400
        if not is_error(out):
            self.delivered_ids.extend(out.token_ids)
            self.delivered_chars += len(out.text)
        self._queue.put_nowait(out)

    def fail(self, status: int, message: str) -> None:
        """End the stream with an error final made by the gateway (worker death, no tokenizer)."""
        if self.finished:
            return
        self.error_status = status
        self.deliver(StreamOut(rid=self.rid, text="", token_ids=[], finish=Finish(type="error", message=message)))

    async def outputs(self) -> AsyncIterator[StreamOut]:
        """Yield each output up to and including the final; an error final raises GatewayError."""
        while True:
            out = await self._queue.get()
            if is_error(out):
                assert out.finish is not None
                raise pipeline_error(self.error_status, out.finish.message or "the request failed", out.finish.param,
                                     self.prompt_param)
            yield out
            if out.finish is not None:
                return


class StreamHub:
    """This gateway's in-flight requests, keyed by rid, fed from its stream subject."""

    def __init__(self, bus: Bus, gateway_id: str, metrics: GatewayMetrics) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.metrics = metrics
        self._streams: dict[str, RequestStream] = {}
        self._by_reply: dict[str, str] = {}
        self._tokens = itertools.count()
        self._inbox = ""
        # Called with (stream, final) for every request that finishes without an error.
        self.on_usage: Callable[[RequestStream, StreamOut], None] | None = None

    async def start(self) -> None:
        subject = self.bus.subjects.gateway_stream(self.gateway_id)
        await self.bus.subscribe(subject, (BatchStreamOut,), self._on_batch)
        self._inbox = self.bus.nc.new_inbox()
        await self.bus.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, rid: str) -> bool:
        return rid in self._streams

    def get(self, rid: str) -> RequestStream | None:
        return self._streams.get(rid)

    def in_flight(self) -> list[RequestStream]:
        return list(self._streams.values())

    def per_worker(self) -> Counter[str]:
        """Unfinished requests per worker id."""
        return Counter(s.worker_id for s in self._streams.values())

    def open(self, rid: str, worker_id: str, model_name: str = "") -> RequestStream:
        """Register a request before it is published, so no output can arrive unclaimed; `model_name`:
        the served name of the worker's model (its metrics' label)."""
        if rid in self._streams:
            raise bad_request(f"request id {rid!r} is already in flight", "rid")
        token = str(next(self._tokens))
        stream = RequestStream(rid, worker_id, token, model_name)
        self._streams[rid] = stream
        self._by_reply[token] = rid
        self.metrics.in_flight.labels(model_name).inc()
        return stream

    def reply_subject(self, stream: RequestStream) -> str:
        """The reply subject a TokenizeRequest carries: NATS answers it only when nobody listens."""
        return f"{self._inbox}.{stream.reply_token}"

    def close(self, stream: RequestStream) -> None:
        """Forget a request (finished, or given up by its client)."""
        if self._streams.get(stream.rid) is stream:
            del self._streams[stream.rid]
            self.metrics.in_flight.labels(stream.model_name).dec()
        self._by_reply.pop(stream.reply_token, None)

    def silent(self, timeout_s: float, now: float | None = None) -> list[RequestStream]:
        """Requests with no output at all for `timeout_s` (counted from their start, or from when their
        worker last said it holds them)."""
        now = time.monotonic() if now is None else now
        return [
            s for s in self._streams.values()
            if s.first_output_at is None and now - (s.checked_at or s.started) > timeout_s
        ]

    def expired(self, now: float | None = None) -> list[RequestStream]:
        """Requests past their own `timeout`."""
        now = time.monotonic() if now is None else now
        return [s for s in self._streams.values() if s.deadline is not None and now > s.deadline]

    async def _on_batch(self, batch: BatchStreamOut, raw: Msg) -> None:
        now = time.monotonic()
        trace.mark_each(batch.items, "gateway.stream")
        for out in batch.items:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue  # aborted or failed here already; late outputs are expected
            self._observe(stream, out, now)
            stream.deliver(out)
            if out.finish is not None:
                self.close(stream)

    def _observe(self, stream: RequestStream, out: StreamOut, now: float) -> None:
        model, metrics = stream.model_name, self.metrics
        if out.token_ids:
            if stream.first_output_at is None:
                metrics.ttft.labels(model).observe(now - stream.started)
                stream.first_output_at = now
            elif stream.last_output_at is not None:
                gap = (now - stream.last_output_at) / len(out.token_ids)
                observe_many(metrics.inter_token.labels(model), gap, len(out.token_ids))
            stream.last_output_at = now
        elif stream.first_output_at is None and out.finish is not None:
            stream.first_output_at = now
        if out.finish is not None and not is_error(out):
            metrics.e2e.labels(model).observe(now - stream.started)
            # Counters only go up: a malformed final's negative count must not stop the batch.
            usage = out.usage or Usage()
            metrics.prompt_tokens.labels(model).inc(max(0, usage.prompt_tokens))
            metrics.generation_tokens.labels(model).inc(max(0, usage.completion_tokens))
            metrics.cached_tokens.labels(model).inc(max(0, usage.cached_tokens))
            if self.on_usage is not None:
                self.on_usage(stream, out)

    async def _on_reply(self, raw: Msg) -> None:
        token = raw.subject.rsplit(".", 1)[-1]
        rid = self._by_reply.get(token)
        stream = self._streams.get(rid) if rid is not None else None
        if stream is None:
            return
        if raw.headers and raw.headers.get("Status") == _NO_RESPONDERS:
            logger.warning("no tokenizer is subscribed to %s; request %s failed", self.bus.subjects.tokenize, rid)
            stream.fail(SERVICE_UNAVAILABLE, f"no tokenizer is serving {self.bus.subjects.tokenize}")
            self.close(stream)
