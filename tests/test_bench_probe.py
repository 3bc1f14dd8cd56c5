"""bench/http_burst.py's SseProbe, which times the benchmarks' streamed requests: against a scripted
HTTP server (raw bytes on a socket), it finds the first matching SSE event however the response is cut
into chunks and reads, stops its clock at the read that delivered that event (before parsing it),
keeps the connection usable for the next request, and raises on an error status."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import pytest

from bench.http_burst import HttpStatusError, SseProbe


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class ScriptedServer:
    """Accepts one connection; for each request it reads, plays the next script: a list of byte
    strings sent with a pause between them, or a callable run in between."""

    def __init__(self, scripts: list[list[bytes | float]]) -> None:
        self.scripts = scripts
        self.requests: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = b""
            for script in self.scripts:
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
                while len(buf) < length:
                    buf += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + buf[:length])
                buf = buf[length:]
                for step in script:
                    if isinstance(step, float):
                        time.sleep(step)
                    else:
                        conn.sendall(step)


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def wants_ids(e: dict) -> bool:
    return bool(e["output_ids"])


def test_the_first_matching_event_is_found_across_chunks_and_reads() -> None:
    first, second = event({"output_ids": []}), event({"output_ids": [7]})
    # The matching event is cut in two chunks, and the second half arrives 0.3 s later; a later
    # event arrives 0.3 s after that and is not on the clock.
    body = chunked(first + second[:9], second[9:], event({"output_ids": [7, 8]}), b"data: [DONE]\n\n")
    cut = body.index(second[9:]) - 4  # inside the second chunk's size line
    server = ScriptedServer([[SSE_HEAD + body[:cut], 0.3, body[cut:cut + 20], 0.3, body[cut + 20:]]])
    probe = SseProbe(server.url)
    before = time.monotonic_ns()
    seconds = probe.first_event("/generate", {"input_ids": [1, 2]}, wants_ids)
    assert 0.55 < seconds < 1.5, seconds  # the read holding the event's end came after both pauses
    assert before <= probe.sent_ns < probe.first_ns and abs((probe.first_ns - probe.sent_ns) / 1e9 - seconds) < 0.01
    request = server.requests[0]
    assert request.startswith(b"POST /generate HTTP/1.1\r\n") and b"content-type: application/json" in request.lower()
    assert json.loads(request.split(b"\r\n\r\n", 1)[1]) == {"input_ids": [1, 2]}
    probe.close()


def test_the_clock_stops_at_the_read_not_after_the_rest_of_the_response() -> None:
    server = ScriptedServer([[SSE_HEAD + chunked(event({"output_ids": [1]}))[:-5], 1.0, b"0\r\n\r\n"]])
    probe = SseProbe(server.url)
    assert probe.first_event("/generate", {}, wants_ids) < 0.8  # the response ended 1 s later
    probe.close()


@pytest.mark.parametrize("matches, expected", [(lambda e: True, "ok"), (wants_ids, "no match")])
def test_the_connection_serves_the_next_request_and_a_stream_without_a_match_raises(
    matches: Callable[[dict], bool], expected: str
) -> None:
    answer = SSE_HEAD + chunked(event({"output_ids": []}), b"data: [DONE]\n\n")
    server = ScriptedServer([[answer], [answer]])
    probe = SseProbe(server.url)
    for _ in range(2):
        if expected == "ok":
            assert probe.first_event("/generate", {}, matches) >= 0
        else:
            with pytest.raises(HttpStatusError, match="no matching event"):
                probe.first_event("/generate", {}, matches)
    assert len(server.requests) == 2
    probe.close()


def test_an_error_status_raises_with_the_answer_and_leaves_the_connection_usable() -> None:
    error = b'{"error": {"message": "input_ids: bad"}}'
    server = ScriptedServer([
        [b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)],
        [SSE_HEAD + chunked(event({"output_ids": [3]}))],
    ])
    probe = SseProbe(server.url)
    with pytest.raises(HttpStatusError, match="HTTP 400 for /generate: .*input_ids: bad"):
        probe.first_event("/generate", {}, wants_ids)
    assert probe.first_event("/generate", {}, wants_ids) >= 0
    probe.close()


def test_a_server_that_closes_mid_answer_is_an_error() -> None:
    server = ScriptedServer([[SSE_HEAD + b"5\r\nda"]])
    probe = SseProbe(server.url)
    with pytest.raises(ConnectionError, match="closed the connection"):
        probe.first_event("/generate", {}, wants_ids)
    probe.close()
