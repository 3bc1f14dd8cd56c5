"""The detokenizer service: `{p}.detok.{wid}` (BatchTokenOut, at most one per worker step) ->
`{p}.gateway.{gid}.stream` (BatchStreamOut, at most one per gateway per step).

With `--worker-id W` it serves that worker; without, it subscribes `{p}.detok.*` and serves every worker
of the deployment (which must then all serve one model, the one whose tokenizer it loads). Never run
two detokenizers for the same worker: each would publish every delta (per-request state rules out a
queue group). A worker started with `--with-detokenizer` runs the same StreamPublisher in its own process
and publishes nothing on `{p}.detok.*`.

Metrics, each labelled with the model_name whose tokenizer decodes: rs_detokenizer_message_seconds
(histogram), rs_detokenizer_active_requests, rs_detokenizer_stream_messages_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.detokenizer import Detokenizer
from shared.bus import Bus, PayloadTooLarge
from shared.hf_tokenizer import load_hf_tokenizer
from shared.metrics import (
    MESSAGE_LATENCY_BUCKETS,
    MODEL_LABEL,
    MetricsServer,
    model_label,
    start_metrics_server,
)
from shared.protocol import PROTOCOL_VERSION, BatchStreamOut, BatchTokenOut
from shared.service import Service, connect_bus, drain_bus, publish_error

logger = logging.getLogger(__name__)


class DetokenizerMetrics:
    """The detokenizer's Prometheus metrics, for the model `model_name`."""

    def __init__(self, model_name: str) -> None:
        self.latency = Histogram(
            "rs_detokenizer_message_seconds", "time to detokenize and publish one BatchTokenOut", [MODEL_LABEL],
            buckets=MESSAGE_LATENCY_BUCKETS,
        ).labels(model_name)
        self.active = Gauge("rs_detokenizer_active_requests", "requests with detokenizer state", [MODEL_LABEL]).labels(
            model_name
        )
        self.stream_messages = Counter(
            "rs_detokenizer_stream_messages", "BatchStreamOut messages published", [MODEL_LABEL]
        ).labels(model_name)


class StreamPublisher:
    """Detokenizes worker steps of the model `model_name` and publishes each gateway's BatchStreamOut."""

    def __init__(self, bus: Bus, tokenizer: Any, model_name: str) -> None:
        self.bus = bus
        self.detok = Detokenizer(tokenizer)
        self.metrics = DetokenizerMetrics(model_name)

    async def handle(self, batch: BatchTokenOut) -> None:
        started = time.perf_counter()
        for gateway_id, message in self.detok.process(batch).items():
            await self._publish(gateway_id, message)
        self.metrics.active.set(len(self.detok))
        self.metrics.latency.observe(time.perf_counter() - started)

    async def _publish(self, gateway_id: str, message: BatchStreamOut) -> None:
        subject = self.bus.subjects.gateway_stream(gateway_id)
        try:
            await self.bus.publish(subject, message)
            self.metrics.stream_messages.inc()
            return
        except PayloadTooLarge:
            logger.warning("a step's stream message for gateway %s exceeds max_payload; sending per request", gateway_id)
        for item in message.items:
            try:
                await self.bus.publish(subject, BatchStreamOut(v=PROTOCOL_VERSION, items=[item]))
                self.metrics.stream_messages.inc()
            except PayloadTooLarge as exc:
                await publish_error(self.bus, gateway_id, item.rid, f"an output message was too large: {exc}")

    def forget_silent_workers(self, silent_for: float) -> None:
        self.detok.forget_silent_workers(silent_for)
        self.metrics.active.set(len(self.detok))


class DetokenizerService(Service):
    """A standalone detokenizer process."""

    name = "detokenizer"

    def __init__(self, config: DetokenizerConfig) -> None:
        super().__init__()
        self.config = config
        self.bus: Bus | None = None
        self.publisher: StreamPublisher | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._metrics_server: MetricsServer | None = None

    async def start(self) -> None:
        cfg = self.config
        # The tokenizer first: a model that cannot be found is named as such, with or without NATS.
        tokenizer = await asyncio.to_thread(load_hf_tokenizer, cfg.model_path, cfg.tokenizer_path, None, cfg.revision)
        name = await asyncio.to_thread(model_label, cfg.model_path)
        self.bus = await connect_bus(cfg, self.name)
        self.publisher = StreamPublisher(self.bus, tokenizer, name)
        subject = self.bus.subjects.detok(cfg.worker_id or "*")
        await self.bus.subscribe(subject, (BatchTokenOut,), self._on_batch)
        self._sweeper = asyncio.create_task(self._sweep())
        self._metrics_server = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
        logger.info("detokenizer for %s on %s", cfg.model_path or "the default model", subject)

    async def _on_batch(self, batch: BatchTokenOut, raw: Msg) -> None:
        assert self.publisher is not None
        await self.publisher.handle(batch)

    async def _sweep(self) -> None:
        assert self.publisher is not None
        period = min(10.0, self.config.silent_worker_timeout / 2)
        while True:
            await asyncio.sleep(period)
            self.publisher.forget_silent_workers(self.config.silent_worker_timeout)

    async def drain(self) -> None:
        """NATS drain: steps already received are detokenized and published before the connection closes."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await drain_bus(self.bus, self.config.drain_timeout)
        if self._metrics_server is not None:
            self._metrics_server.stop()
