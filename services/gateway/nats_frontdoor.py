"""The NATS front door, for clients that live on NATS.

`{p}.v1.generate` (queue group "gateway": one gateway takes each request): a NatsGenerateRequest with
a reply inbox. Replies go to that inbox: NatsGenerateChunk text deltas (stream=True) and always a last
chunk with final=True carrying finish and usage (and, with speculative decoding, spec_accept_length and
spec_accept_rate), or `error` (with the HTTP-style status in its text). With return_logprob and
logprob_start_len, one chunk (the one that ends the prefill; not streamed, the final) also carries the
prompt's tokens from that position on and their log-probs (prompt_token_ids, prompt_logprobs).
`{p}.v1.abort` (every gateway hears it, no queue group; the one that holds the request aborts it):
NatsAbort(rid). A message that does not decode is logged and answered with an error final when it
has a reply inbox; the front door keeps serving.

With API keys configured, both carry `Authorization: Bearer <key>` as a NATS message header, checked
by the same code as HTTP and gRPC (services/gateway/auth.py): a refused generate gets an error final
("401: ...", "503: ...", or "429: ..." with retry_after); its tokens count as the key's usage. An
abort is checked only by the gateway that holds the request (so it counts once against the key's
limit), and a user key may abort only its own requests (services/gateway/aborts.py); a refused abort
is logged and dropped, as aborts have no reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.gateway.auth import Verdict, authorize, current_key
from services.gateway.completion import Completion
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import GatewayError
from services.gateway.generate_spec import GenerateSpec
from services.gateway.metrics import begin_request
from services.gateway.streams import RequestStream
from shared.bus import PayloadTooLarge
from shared.protocol import (
    PROTOCOL_VERSION,
    NatsAbort,
    NatsGenerateChunk,
    NatsGenerateRequest,
    PromptLogprobs,
    decoder,
    usage_fields,
)

logger = logging.getLogger(__name__)

QUEUE_GROUP = "gateway"
ENDPOINT = "nats.v1.generate"


class NatsFrontDoor:
    """Serves {p}.v1.generate and {p}.v1.abort for one gateway."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.bus = dispatcher.bus
        self._decode_request = decoder(NatsGenerateRequest)
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        subjects = self.bus.subjects
        self._subs = [
            await self.bus.nc.subscribe(subjects.v1_generate, queue=QUEUE_GROUP, cb=self._on_generate),
            await self.bus.subscribe(subjects.v1_abort, (NatsAbort,), self._on_abort),
        ]

    async def stop_taking(self) -> None:
        """Stop receiving new requests (in-flight ones go on)."""
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []

    async def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for in-flight requests to send their finals."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def _on_generate(self, raw: Msg) -> None:
        # nats-py runs one callback at a time per subscription: serve each request in its own task.
        task = asyncio.create_task(self._serve(raw))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _authorize(self, raw: Msg) -> Verdict:
        """The message's Authorization header checked and counted against its key's limit; with no
        keys configured every message is admitted (without a key)."""
        if not self.dispatcher.keys.enabled:
            return Verdict(None)
        value = next((v for k, v in (raw.headers or {}).items() if k.lower() == "authorization"), "")
        return await authorize(self.dispatcher.keys, value)

    async def _on_abort(self, msg: NatsAbort, raw: Msg) -> None:
        if msg.rid not in self.dispatcher.hub:
            return
        verdict = await self._authorize(raw)
        if verdict.status != 200:
            logger.warning("abort of %s on %s refused: %d %s", msg.rid, raw.subject, verdict.status, verdict.message)
            return
        try:
            await self.dispatcher.aborts.abort_held(msg.rid, verdict.key)
        except GatewayError as exc:
            logger.warning("abort of %s on %s refused: %d %s", msg.rid, raw.subject, exc.status, exc.message)

    async def _reply(self, raw: Msg, chunk: NatsGenerateChunk) -> None:
        try:
            await self.bus.respond(raw, chunk)
        except PayloadTooLarge as exc:
            await self.bus.respond(raw, _error(chunk.rid, 413, str(exc)))

    async def _serve(self, raw: Msg) -> None:
        begin_request()
        # Checked before the body is read, as the HTTP middleware does.
        verdict = await self._authorize(raw)
        if verdict.status != 200:
            self.dispatcher.metrics.count(ENDPOINT, verdict.status)
            await self._reply(raw, _error("", verdict.status, verdict.message, verdict.retry_after))
            return
        # This task's own context: the stream records the key, and its usage counts against it.
        current_key.set(verdict.key)
        try:
            request = self._decode_request.decode(raw.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed request on %s: %s", raw.subject, exc)
            self.dispatcher.metrics.count(ENDPOINT, 400)
            await self._reply(raw, _error("", 400, f"malformed NatsGenerateRequest: {exc}"))
            return
        if request.v != PROTOCOL_VERSION:
            self.dispatcher.metrics.count(ENDPOINT, 400)
            await self._reply(raw, _error(request.rid or "", 400, f"protocol v{request.v} is not v{PROTOCOL_VERSION}"))
            return
        if not raw.reply:
            logger.warning("dropped a request on %s without a reply inbox", raw.subject)
            return
        stream: RequestStream | None = None
        status = 200
        try:
            stream = await self.dispatcher.submit(spec_from_nats(request))
            await self._relay(raw, request, stream)
        except GatewayError as exc:
            status = exc.status
            rid = stream.rid if stream is not None else request.rid or ""
            await self._reply(raw, _error(rid, exc.status, exc.message))
        except Exception:  # noqa: BLE001 - a bug must still answer the client, never leave it waiting
            logger.exception("request on %s failed", raw.subject)
            status = 500
            rid = stream.rid if stream is not None else request.rid or ""
            await self._reply(raw, _error(rid, status, "internal error in the gateway (its log has the traceback)"))
        finally:
            if stream is not None:
                self.dispatcher.release(stream)
            self.dispatcher.metrics.count(ENDPOINT, status)

    async def _relay(self, raw: Msg, request: NatsGenerateRequest, stream: RequestStream) -> None:
        whole = Completion(stream.rid)
        async for out in stream.outputs():
            whole.add(out)
            prompt = out.logprobs.prompt if out.logprobs is not None else None
            if request.stream and out.finish is None and (out.text or out.token_ids or prompt is not None):
                chunk = NatsGenerateChunk(
                    v=PROTOCOL_VERSION, rid=stream.rid, text=out.text, token_ids=out.token_ids,
                    logprobs=out.logprobs.values if out.logprobs is not None else None, **prompt_fields(prompt),
                )
                await self._reply(raw, chunk)
            elif out.finish is not None:
                final: dict[str, Any] = (
                    {"text": out.text, "token_ids": out.token_ids,
                     "logprobs": out.logprobs.values if out.logprobs is not None else None, **prompt_fields(prompt)}
                    if request.stream
                    else {"text": whole.text, "token_ids": whole.token_ids, "logprobs": whole.logprobs or None,
                          **prompt_fields(whole.prompt_logprobs)}
                )
                await self._reply(
                    raw,
                    NatsGenerateChunk(
                        v=PROTOCOL_VERSION,
                        rid=stream.rid,
                        final=True,
                        finish=out.finish,
                        **usage_fields(whole.usage),
                        **final,
                    ),
                )


# What a NATS request states of its generation: every GenerateSpec field the two share (the others,
# the chat template's add_generation_prompt and tools, keep GenerateSpec's defaults).
_CARRIED = tuple(f.name for f in dataclasses.fields(GenerateSpec) if f.name in NatsGenerateRequest.__struct_fields__)


def spec_from_nats(request: NatsGenerateRequest) -> GenerateSpec:
    """The generation a request on {p}.v1.generate asks for."""
    return GenerateSpec(**{f: getattr(request, f) for f in _CARRIED})


def prompt_fields(prompt: PromptLogprobs | None) -> dict[str, Any]:
    """A prompt's log-probs as NatsGenerateChunk's keyword arguments (none asked: no arguments)."""
    if prompt is None:
        return {}
    return {"prompt_token_ids": prompt.token_ids, "prompt_logprobs": prompt.values}


def _error(rid: str, status: int, message: str, retry_after: int | None = None) -> NatsGenerateChunk:
    return NatsGenerateChunk(v=PROTOCOL_VERSION, rid=rid, final=True, error=f"{status}: {message}", retry_after=retry_after)
