"""Who may abort which request, the same on every door (HTTP /abort_request, gRPC Abort, NATS
{p}.v1.abort), and a user key's abort of a request that another gateway replica holds.

An admin key, or anyone when no keys are configured, may abort any request: Dispatcher.abort, which
sends an rid this gateway does not hold to every live worker. A user key may abort only the requests
it made itself. One held here is aborted, another key's is a 403. An rid not held here may belong to
another gateway replica: it is published on {p}.gateway.abort with the key's id, and the gateway that
holds it aborts it only when that key made it. Nobody answers, so the caller learns only that the
request was not held by the gateway it asked (as with an admin's abort of such an rid).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from services.gateway.auth import ApiKey
from services.gateway.errors import FORBIDDEN, GatewayError
from services.gateway.streams import RequestStream
from shared.protocol import PROTOCOL_VERSION, GatewayAbort

if TYPE_CHECKING:
    from services.gateway.dispatch import Dispatcher

logger = logging.getLogger(__name__)


class Aborts:
    """Aborts by rid on behalf of a key, for one gateway; listens on {p}.gateway.abort."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def start(self) -> None:
        bus = self.dispatcher.bus
        await bus.subscribe(bus.subjects.gateway_abort, (GatewayAbort,), self._on_gateway_abort)

    def acts_for_all(self, key: ApiKey | None) -> bool:
        """Whether `key` may abort any request (admin scope, or an open server)."""
        return not self.dispatcher.keys.enabled or (key is not None and key.is_admin)

    def check(self, key: ApiKey | None, stream: RequestStream) -> None:
        """GatewayError 403 unless `key` may abort `stream`."""
        if self.acts_for_all(key) or (key is not None and _made_by(stream, key.key_id)):
            return
        raise GatewayError(
            FORBIDDEN,
            f"request {stream.rid!r} was made with another API key; aborting it needs that key or an admin key",
            "rid",
        )

    async def abort(self, rid: str, key: ApiKey | None) -> bool:
        """Abort `rid` for `key`; True when this gateway holds it. GatewayError 403 when it is held
        here and `key` may not abort it."""
        if self.acts_for_all(key):
            return await self.dispatcher.abort(rid)
        if await self.abort_held(rid, key):
            return True
        if key is not None:
            bus = self.dispatcher.bus
            msg = GatewayAbort(v=PROTOCOL_VERSION, rid=rid, key_id=key.key_id, gateway_id=self.dispatcher.gateway_id)
            await bus.publish(bus.subjects.gateway_abort, msg)
        return False

    async def abort_held(self, rid: str, key: ApiKey | None) -> bool:
        """Abort `rid` if this gateway holds it (checked against `key` first); False when it does not."""
        stream = self.dispatcher.hub.get(rid)
        if stream is None:
            return False
        self.check(key, stream)
        await self.dispatcher.abort(rid)
        return True

    async def _on_gateway_abort(self, msg: GatewayAbort, raw: Msg) -> None:
        if msg.gateway_id == self.dispatcher.gateway_id:
            return
        stream = self.dispatcher.hub.get(msg.rid)
        if stream is None:
            return
        if not _made_by(stream, msg.key_id):
            logger.warning("abort of %s from gateway %s ignored: another key made it", msg.rid, msg.gateway_id)
            return
        await self.dispatcher.abort(msg.rid)


def _made_by(stream: RequestStream, key_id: str) -> bool:
    return stream.api_key is not None and stream.api_key.key_id == key_id
