"""A burst of HTTP/1.1 POSTs sent at once, each on its own connection, for benchmarks that time the
server rather than the client.

httpx's AsyncClient spends client CPU per request that grows with the connections in its pool: on a
2-vCPU machine, 64 concurrent `/generate` calls cost 9.6 ms of client CPU each (1.2 ms one at a time),
so the burst left the client over ~1 s and the server saw 64 requests trickle in one every 18-21 ms,
not a batch. Here the connections are opened (and each has served a GET, so the server has accepted
it) and every request is encoded before the clock starts; sending is one socket write per request, and
h11 (uvicorn's and httpx's own parser) reads the answers.

    burst = await HttpBurst.open("http://127.0.0.1:8000", len(bodies), warm_path="/health")
    seconds, answers = await burst.post_json("/generate", bodies)   # answers: decoded JSON, in order
    await burst.close()
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import h11

READ_CHUNK = 1 << 16


def encode_request(conn: h11.Connection, host: str, port: int, method: str, path: str, body: bytes | None) -> bytes:
    """One HTTP/1.1 request on `conn`'s keep-alive connection, as bytes (a JSON body when given)."""
    headers = [("Host", f"{host}:{port}")]
    if body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    parts = [conn.send(h11.Request(method=method, target=path, headers=headers))]
    if body is not None:
        parts.append(conn.send(h11.Data(data=body)))
    parts.append(conn.send(h11.EndOfMessage()))
    return b"".join(part or b"" for part in parts)


class HttpStatusError(RuntimeError):
    """A request of the burst was answered with a status other than 200."""


class HttpBurst:
    """`count` keep-alive connections to one server, used together."""

    def __init__(self, host: str, port: int, conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
        self.host, self.port = host, port
        self._conns = conns
        self._h11 = [h11.Connection(h11.CLIENT) for _ in conns]

    @classmethod
    async def open(cls, url: str, count: int, warm_path: str | None = None) -> HttpBurst:
        """`count` connections; with `warm_path`, each GETs it once (a connection the server has not
        accepted yet would make its first request pay for the accept)."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        conns = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(count)))
        burst = cls(host, port, list(conns))
        if warm_path is not None:
            for conn, (_, writer) in zip(burst._h11, burst._conns):
                writer.write(encode_request(conn, burst.host, burst.port, "GET", warm_path, None))
            await asyncio.gather(*(burst._answer(conn, reader) for conn, (reader, _) in zip(burst._h11, burst._conns)))
        return burst

    async def close(self) -> None:
        for _, writer in self._conns:
            writer.close()
        await asyncio.gather(*(writer.wait_closed() for _, writer in self._conns), return_exceptions=True)

    async def _answer(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        status, chunks = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(READ_CHUNK))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                body = b"".join(chunks)
                if status != 200:
                    raise HttpStatusError(f"HTTP {status}: {body[:500]!r}")
                return json.loads(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection mid-answer")

    async def post_json(self, path: str, bodies: list[Any]) -> tuple[float, list[Any]]:
        """POST each body (one per connection) at once; seconds from the first write to the last
        answer, and the answers in order."""
        if len(bodies) > len(self._conns):
            raise ValueError(f"{len(bodies)} bodies for {len(self._conns)} connections")
        wires = [encode_request(conn, self.host, self.port, "POST", path, json.dumps(body).encode()) for conn, body in zip(self._h11, bodies)]
        start = time.perf_counter()
        for (_, writer), wire in zip(self._conns, wires):
            writer.write(wire)
        answers = await asyncio.gather(
            *(self._answer(conn, reader) for conn, (reader, _) in zip(self._h11, self._conns))
        )
        return time.perf_counter() - start, list(answers)


class SseProbe:
    """One blocking keep-alive connection that times streamed POSTs to their first matching SSE event,
    with no client library between the clock and the socket (httpx's sync client costs ~0.3-1 ms of
    client CPU per request, which a pipeline-vs-in-process comparison would book to the server).

    The clock stops at the read that delivered the first matching event, not once the client has
    parsed it: the response is framed by hand (head, chunked or Content-Length body, SSE lines), and
    the JSON is decoded after that read's time is taken. h11 parsing the head and chunk in Python cost
    the client 0.1 ms (warm) to 0.25 ms (after a CPU prefill left its caches cold) on a 2-vCPU host,
    which the Engine side of a comparison does not pay.

        probe = SseProbe("http://127.0.0.1:8000")
        seconds = probe.first_event("/generate", body, lambda event: bool(event["output_ids"]))
        probe.sent_ns, probe.first_ns   # CLOCK_MONOTONIC of the write and of that read (shared/trace.py)
    """

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        import socket

        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._sock = socket.create_connection((self.host, self.port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._read_at = 0.0
        self._read_ns = 0
        self.sent_ns = 0
        self.first_ns = 0

    def close(self) -> None:
        self._sock.close()

    def _read(self) -> None:
        data = self._sock.recv(READ_CHUNK)
        self._read_at, self._read_ns = time.perf_counter(), time.monotonic_ns()
        if not data:
            raise ConnectionError("the server closed the connection mid-answer")
        self._buf += data

    def _take_line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._read()
        line = bytes(self._buf[:end])
        del self._buf[:end + 2]
        return line

    def _take(self, size: int) -> bytes:
        while len(self._buf) < size:
            self._read()
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    def _head(self) -> tuple[int, dict[bytes, bytes]]:
        status = int(self._take_line().split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        while line := self._take_line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def _body_parts(self, headers: dict[bytes, bytes]) -> Any:
        """The body's pieces as they arrive (chunked, or Content-Length); the connection is then at
        the next response."""
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while size := int(self._take_line().split(b";", 1)[0], 16):
                yield self._take(size)
                self._take_line()
            while self._take_line():  # trailers, then the empty line
                pass
        else:
            yield self._take(int(headers.get(b"content-length", b"0")))

    def first_event(self, path: str, body: Any, matches: Any) -> float:
        """Seconds from writing the request to the read that delivered the first `data: {...}` event
        whose JSON `matches`; the rest of the response is read (not timed) so the connection can
        serve the next request."""
        payload = json.dumps(body).encode()
        wire = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        first: float | None = None
        start = time.perf_counter()
        self.sent_ns = time.monotonic_ns()
        self._sock.sendall(wire)
        status, headers = self._head()
        if status != 200:
            answer = b"".join(self._body_parts(headers))
            raise HttpStatusError(f"HTTP {status} for {path}: {answer[:500]!r}")
        pending = b""
        for part in self._body_parts(headers):
            if first is not None:
                continue
            pending += part
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {") and matches(json.loads(line[6:])):
                    first, self.first_ns = self._read_at - start, self._read_ns
                    break
        if first is None:
            raise HttpStatusError(f"no matching event in the answer to {path}")
        return first
