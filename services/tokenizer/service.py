"""The tokenizer service: `{p}.tokenize` (queue group) -> `{p}.worker.{wid}.requests`.

`{p}.tokenize.text` (the same queue group, request/reply) answers a gateway's /tokenize and
/detokenize: ids of text or chat messages, or text of ids.

Stateless, so any number of replicas share the queue group. Each TokenizeRequest becomes the
GenerateRequest for the worker the gateway chose (`worker_id`); a request that cannot be served (empty
prompt, too long, ids outside the vocabulary, bad sampling values) ends at once with an error final on
its gateway's stream subject, naming the field.

Metrics, each labelled with the model_name whose tokenizer this is: rs_tokenizer_message_seconds
(histogram), rs_tokenizer_requests_total{status=ok|error}, rs_tokenizer_prompt_tokens_total.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from services.tokenizer.config import TokenizerConfig
from shared.bus import Bus, PayloadTooLarge
from shared.metrics import (
    MESSAGE_LATENCY_BUCKETS,
    MODEL_LABEL,
    MetricsServer,
    model_label,
    start_metrics_server,
)
from shared.prompt_tokenizer import PromptTokenizer, is_quick
from shared.protocol import PROTOCOL_VERSION, TextTokenize, TextTokenized, TokenizeRequest
from shared.service import Service, connect_bus, drain_bus, is_subject_token, publish_error

logger = logging.getLogger(__name__)


class TokenizerMetrics:
    """The tokenizer's Prometheus metrics, for the model `model_name`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latency = Histogram(
            "rs_tokenizer_message_seconds", "time to handle one TokenizeRequest", [MODEL_LABEL],
            buckets=MESSAGE_LATENCY_BUCKETS,
        ).labels(model_name)
        self._requests = Counter("rs_tokenizer_requests", "TokenizeRequests handled", [MODEL_LABEL, "status"])
        self.prompt_tokens = Counter(
            "rs_tokenizer_prompt_tokens", "prompt tokens forwarded to workers", [MODEL_LABEL]
        ).labels(model_name)

    def count_request(self, status: str) -> None:
        self._requests.labels(self.model_name, status).inc()


class TokenizerService(Service):
    """One tokenizer replica."""

    name = "tokenizer"

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        self.config = config
        self.bus: Bus | None = None
        self.prompts: PromptTokenizer | None = None
        self.metrics: TokenizerMetrics | None = None  # made in start(), once the model is known
        self._metrics_server: MetricsServer | None = None

    async def start(self) -> None:
        cfg = self.config
        # The tokenizer first: a model that cannot be found is named as such, with or without NATS.
        self.prompts = await asyncio.to_thread(
            PromptTokenizer.load, cfg.model_path, cfg.context_length, cfg.tokenizer_path, cfg.chat_template, cfg.revision
        )
        self.metrics = TokenizerMetrics(await asyncio.to_thread(model_label, cfg.model_path))
        self.bus = await connect_bus(cfg, self.name)
        await self.bus.subscribe(
            self.bus.subjects.tokenize, (TokenizeRequest,), self._on_request, queue=cfg.queue_group
        )
        await self.bus.subscribe(
            self.bus.subjects.tokenize_text, (TextTokenize,), self._on_text, queue=cfg.queue_group
        )
        self._metrics_server = start_metrics_server(cfg.metrics_port, cfg.metrics_host)
        logger.info(
            "tokenizer for %s (vocab %d, context %d) on %s, queue group %r",
            cfg.model_path or "the default model", self.prompts.vocab_size, self.prompts.context_len,
            self.bus.subjects.tokenize, cfg.queue_group,
        )

    async def _on_request(self, req: TokenizeRequest, raw: Msg) -> None:
        assert self.bus is not None and self.prompts is not None and self.metrics is not None
        started = time.perf_counter()
        if not is_subject_token(req.gateway_id):
            logger.warning("dropped request %s: gateway_id %r is not a subject token", req.rid, req.gateway_id)
            return
        try:
            if not is_subject_token(req.worker_id):
                raise ValueError(f"`worker_id` {req.worker_id!r} is not a valid worker id")
            # Encoding a long prompt takes milliseconds: off the event loop, so NATS keeps flowing. Ids and
            # short text cost less than the hand-off to a thread.
            if is_quick(req):
                out = self.prompts.to_generate(req)
            else:
                out = await asyncio.to_thread(self.prompts.to_generate, req)
            await self.bus.publish(self.bus.subjects.worker_requests(req.worker_id), out)
        except (ValueError, PayloadTooLarge) as exc:
            # PayloadTooLarge is a ValueError too: a prompt too big for NATS is the client's error.
            self.metrics.count_request("error")
            logger.info("request %s refused: %s", req.rid, exc)
            await publish_error(self.bus, req.gateway_id, req.rid, str(exc), param=getattr(exc, "param", None))
        else:
            self.metrics.count_request("ok")
            self.metrics.prompt_tokens.inc(len(out.input_ids))
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)

    async def _on_text(self, msg: TextTokenize, raw: Msg) -> None:
        """/tokenize and /detokenize for gateways without a tokenizer of their own: reply with the answer."""
        assert self.bus is not None and self.prompts is not None
        answer = await asyncio.to_thread(self.prompts.answer, msg)
        try:
            await self.bus.respond(raw, answer)
        except PayloadTooLarge as exc:
            await self.bus.respond(raw, TextTokenized(v=PROTOCOL_VERSION, error=f"the answer is too large: {exc}"))

    async def drain(self) -> None:
        """NATS drain stops the subscription and lets every message already received finish."""
        await drain_bus(self.bus, self.config.drain_timeout)
        if self._metrics_server is not None:
            self._metrics_server.stop()
