"""The gateway's HTTP protocols join the writes of one event-loop turn into one (services/gateway/
http_transport.py): a streamed response's head and first event reach the client in one send()."""

from __future__ import annotations

import asyncio
from typing import Any

from services.gateway.http_transport import CoalescingTransport, http_protocol


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.extra = {"peername": ("127.0.0.1", 1)}

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)


def test_writes_of_one_turn_leave_as_one_in_order() -> None:
    async def main() -> tuple[list[bytes], list[bytes]]:
        raw = RecordingTransport()
        t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.writelines([b"data: 1\n\n", bytearray(b"data: 2\n\n")])
        assert raw.writes == [] and t.get_write_buffer_size() == 37  # nothing leaves within the turn
        await asyncio.sleep(0)
        first = list(raw.writes)
        t.write(b"data: 3\n\n")
        await asyncio.sleep(0)
        return first, raw.writes

    first, every = asyncio.run(main())
    assert first == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: 2\n\n"]
    assert every == [*first, b"data: 3\n\n"]  # a later turn's write is a write of its own


def test_close_sends_what_is_pending_first_and_nothing_after() -> None:
    async def main() -> RecordingTransport:
        raw = RecordingTransport()
        t = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"last")
        t.close()
        assert raw.writes == [b"last"] and raw.closed and t.is_closing()
        t.write(b"too late")  # uvicorn may still write to a closed connection: dropped, as asyncio does
        await asyncio.sleep(0)
        assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the wrapped transport's
        return raw

    assert asyncio.run(main()).writes == [b"last"]


async def _serve_and_read(impl: str) -> list[bytes]:
    """An ASGI app that sends a head and two body parts in one go, then one more after a pause, served
    by the gateway's protocol class; what each recv() of the client got."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b"data: later\n\n", "more_body": False})

    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=http_protocol(impl), lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    chunks = []
    while True:
        data = await reader.read(65536)
        if not data:
            break
        chunks.append(data)
        if b"0\r\n\r\n" in data:
            break
    writer.close()
    server.should_exit = True
    await task
    return chunks


def test_a_streamed_head_and_first_event_arrive_in_one_read() -> None:
    for impl in ("httptools", "h11"):
        chunks = asyncio.run(_serve_and_read(impl))
        assert len(chunks) == 2, (impl, chunks)
        assert chunks[0].startswith(b"HTTP/1.1 200 OK\r\n") and chunks[0].endswith(b"data: first\n\n\r\n"), chunks
        assert b"data: later" in chunks[1] and chunks[1].endswith(b"0\r\n\r\n")



def _first_read_while_blocked(impl: str, flush: bool, complete: bool) -> tuple[bytes, bool]:
    """Serve one request with an app that sends a head and an event (and, with `complete`, ends the
    response) and then blocks its event loop for 0.5 s; a client thread reads. What the client's first
    read got, and whether it got it while the server's loop was still blocked."""
    import socket
    import threading
    import time

    import uvicorn

    from services.gateway.http_transport import flush_writes

    unblocked = threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": not complete})
        if flush:
            flush_writes(scope)
        time.sleep(0.5)  # the loop is blocked: only writes already made reach the client
        unblocked.set()
        if not complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    got: dict[str, Any] = {}

    def client(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            got["data"] = sock.recv(65536)
            got["while_blocked"] = not unblocked.is_set()

    async def main() -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=http_protocol(impl), lifespan="off", log_config=None)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        reader = threading.Thread(target=client, args=(server.servers[0].sockets[0].getsockname()[1],))
        reader.start()
        while reader.is_alive():
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task

    asyncio.run(main())
    return got["data"], got["while_blocked"]


def test_flush_writes_sends_the_head_and_first_event_at_once() -> None:
    for impl in ("httptools", "h11"):
        data, while_blocked = _first_read_while_blocked(impl, flush=True, complete=False)
        assert while_blocked, impl
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"data: first\n\n\r\n"), (impl, data)
        # Without the flush, the same writes wait for the loop's turn to end (and then leave with the
        # closing chunk, which the app sends before that turn ends).
        data, while_blocked = _first_read_while_blocked(impl, flush=False, complete=False)
        assert not while_blocked and data.endswith(b"data: first\n\n\r\n0\r\n\r\n"), (impl, data)


def test_a_completed_response_is_written_at_once_in_one_send() -> None:
    for impl in ("httptools", "h11"):
        data, while_blocked = _first_read_while_blocked(impl, flush=False, complete=True)
        assert while_blocked, impl
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"data: first\n\n\r\n0\r\n\r\n"), (impl, data)


def test_flush_writes_is_a_no_op_without_the_gateway_protocol() -> None:
    from services.gateway.http_transport import flush_writes

    flush_writes({"type": "http", "state": {}})
    flush_writes({"type": "http"})
