"""The NATS bus every service uses: connect with reconnect (logged), publish with a max_payload check,
subscribe with decoding (malformed messages are logged and dropped), request/reply, streamed replies
over an inbox ending in an explicit final message, and an ordered drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATSClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.busy_poll import BusyPoll
from shared.nats_connection import redact_url
from shared.protocol import PROTOCOL_VERSION, Subjects, decoder, encode

logger = logging.getLogger(__name__)

Handler = Callable[[Any, Msg], Awaitable[None]]


class PayloadTooLarge(ValueError):
    """A message larger than the server's max_payload: the caller answers 413/400, never times out."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the NATS max_payload of {limit} bytes ({subject})")
        self.size, self.limit = size, limit


class NatsAuthError(ConnectionError):
    """NATS refused our credentials (authorization violation, expired or revoked credentials)."""


class Bus:
    """One service's NATS connection."""

    def __init__(self, nc: NATSClient, subjects: Subjects, name: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.name = name
        # Touched by every message this connection delivers (a no-op unless the service busy-polls).
        self.poller = BusyPoll()

    @classmethod
    async def connect(
        cls, url: str, name: str, prefix: str = "rs", connect_timeout: float = 5.0,
        errors: list[Exception] | None = None, **options: Any,
    ) -> Bus:
        """Connect (failing after connect_timeout if NATS is unreachable, NatsAuthError at once if it
        refuses our credentials); later losses reconnect forever, each loss and recovery logged once.
        Every connection error is appended to `errors` (to say why a connect that timed out failed).
        `options` go to nats-py's connect: credentials, tls, inbox_prefix (NatsConnection.connect_options)."""
        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        shown = redact_url(url)

        async def disconnected() -> None:
            if nc.is_closed or nc.is_draining:
                return  # our own drain or close, not a loss
            logger.warning("%s: lost the NATS connection to %s; reconnecting", name, shown)

        async def reconnected() -> None:
            logger.warning("%s: reconnected to NATS at %s", name, shown)

        async def error(exc: Exception) -> None:
            if errors is not None:
                errors.append(exc)
            text = str(exc).lower()
            if ("authorization" in text or "authentication" in text) and not refused.done():
                refused.set_result(exc)
            if "permissions violation" in text:
                # A subject this user may not use: a deployment whose NATS permissions miss a subject.
                logger.error("%s: NATS refused: %s", name, exc)
            else:
                logger.debug("%s: NATS error: %s", name, exc)

        nc = NATSClient()
        connecting = asyncio.ensure_future(
            nc.connect(
                url,
                name=name,
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
                **options,
            )
        )
        try:
            # nats-py retries a refused login for ever; a refusal is final here, so stop at the first.
            await asyncio.wait((connecting, refused), return_when=asyncio.FIRST_COMPLETED)
            if not connecting.done():
                raise NatsAuthError(str(refused.result()).removeprefix("nats: ").strip("' "))
            connecting.result()
        finally:
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await connecting
                with contextlib.suppress(Exception):
                    await nc.close()
        return cls(nc, Subjects(prefix), name)

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    def encode_checked(self, subject: str, msg: msgspec.Struct) -> bytes:
        data = encode(msg)
        if len(data) > self.max_payload:
            raise PayloadTooLarge(subject, len(data), self.max_payload)
        return data

    async def publish(self, subject: str, msg: msgspec.Struct, reply: str = "") -> None:
        await self.nc.publish(subject, self.encode_checked(subject, msg), reply=reply)

    async def subscribe(
        self, subject: str, types: tuple[type, ...], handler: Handler, queue: str = ""
    ) -> Subscription:
        """Decode each message as one of `types` and call handler(message, raw). A message that does
        not decode, or carries another protocol version, is logged and dropped."""
        dec = decoder(*types)

        async def on_message(raw: Msg) -> None:
            self.poller.touch()
            try:
                msg = dec.decode(raw.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("%s: dropped a malformed message on %s: %s", self.name, raw.subject, exc)
                return
            if getattr(msg, "v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
                logger.warning("%s: dropped a protocol v%s message on %s", self.name, msg.v, raw.subject)
                return
            try:
                await handler(msg, raw)
            except Exception:  # noqa: BLE001 - one bad message must not stop the subscription
                logger.exception("%s: handler for %s failed", self.name, raw.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def request(
        self, subject: str, msg: msgspec.Struct, reply_types: tuple[type, ...], timeout: float = 5.0
    ) -> Any:
        raw = await self.nc.request(subject, self.encode_checked(subject, msg), timeout=timeout)
        return decoder(*reply_types).decode(raw.data)

    async def respond(self, raw: Msg, msg: msgspec.Struct) -> None:
        if raw.reply:
            await self.nc.publish(raw.reply, self.encode_checked(raw.reply, msg))

    async def stream_request(
        self,
        subject: str,
        msg: msgspec.Struct,
        chunk_types: tuple[type, ...],
        is_final: Callable[[Any], bool],
        timeout: float = 30.0,
    ) -> AsyncIterator[Any]:
        """Send msg with a fresh inbox as reply subject and yield every reply until one is final.
        asyncio.TimeoutError when no reply comes for `timeout` seconds."""
        inbox = self.nc.new_inbox()
        dec = decoder(*chunk_types)
        sub = await self.nc.subscribe(inbox)
        try:
            await self.publish(subject, msg, reply=inbox)
            while True:
                raw = await sub.next_msg(timeout=timeout)
                if not raw.data and raw.headers and raw.headers.get("Status") == "503":
                    raise nats.errors.NoRespondersError
                chunk = dec.decode(raw.data)
                yield chunk
                if is_final(chunk):
                    return
        finally:
            await sub.unsubscribe()

    async def drain(self) -> None:
        """Stop receiving, flush what was published, close."""
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=10)
            except (asyncio.TimeoutError, nats.errors.ConnectionClosedError):
                await self.nc.close()
