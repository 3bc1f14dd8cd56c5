"""uvicorn's HTTP protocols with one write per turn of the event loop.

uvicorn writes each ASGI message to the socket as it comes: a streamed response's head, then its first
event, then each later event, each a send() of its own. A client waiting for the first event is woken
by the head, parses it, and sleeps again until the event follows; on a small host every write and
wake-up is a measurable part of the time to the first token. Here the writes a task makes before it
next waits (the head and the first event; the last event, `data: [DONE]` and the closing chunk) are
joined and leave in one send() once the task yields, on the next turn of the loop. Nothing is held
longer than that turn, and closing the connection sends what is pending first.

Waiting for the turn to end would make a first event wait for the rest of its task's turn and a pass
of the loop, so the writes also leave at once where the app knows it is done for now: a finished
response is written when uvicorn completes it, and an app calls `flush_writes(scope)` after a streamed
response's first event (http_streaming.SseResponse does). On the 2-vCPU host the traced last stretch
did not move beyond its run-to-run spread either way (bench/results/pipeline_cpu_2026-11-30_l_stages.json
against _k_stages.json; bench/HISTORY.md, the CPU pipeline's eleventh-session notes).
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

# Where a request's scope holds its connection's flush: in scope["state"], which uvicorn copies from
# the protocol's app_state for every request (the connection puts its flush there).
FLUSH_WRITES = "radixserve.flush_writes"


def flush_writes(scope: MutableMapping[str, Any]) -> None:
    """Write what this request's connection holds now, not at the end of the loop's turn (a no-op
    under a server without the gateway's protocol)."""
    flush = scope.get("state", {}).get(FLUSH_WRITES)
    if flush is not None:
        flush()


class CoalescingTransport:
    """Wraps an asyncio transport: `write`s of one loop turn leave as one write; the rest is the
    wrapped transport's."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Write what is pending now (a no-op when nothing is, or the connection is closing)."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, set_protocol, ...
        return getattr(self._transport, name)


def coalescing_protocol(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HttpToolsProtocol or H11Protocol) writing through a CoalescingTransport, which
    its requests can flush (flush_writes) and which it flushes as each response completes."""

    class Coalescing(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            coalescing = CoalescingTransport(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
            super().connection_made(coalescing)
            # Every request's scope["state"] is a copy of this dict: this connection's own.
            self.app_state = {**self.app_state, FLUSH_WRITES: coalescing.flush}

        def on_response_complete(self) -> None:
            self.transport.flush()  # the response's last writes leave now, in one send()
            super().on_response_complete()

    Coalescing.__name__ = Coalescing.__qualname__ = f"Coalescing{base.__name__}"
    return Coalescing


def http_protocol(impl: str) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...): 'httptools' or 'h11', coalescing its writes."""
    if impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return coalescing_protocol(HttpToolsProtocol)
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return coalescing_protocol(H11Protocol)
