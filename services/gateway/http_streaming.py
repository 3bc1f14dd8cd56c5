"""What HTTP routes share to stream: SSE framing, merging the streams of n choices into one, starting a
response only once its first output (or error) is known, and abort when the client goes away.

A streaming route awaits the first output before it returns, so an error that comes at once (the
prompt is too long, no tokenizer) is still a 4xx/5xx status; later errors become an SSE error event
followed by `data: [DONE]`. When the client disconnects, SseResponse cancels the response's iterator;
its `finally` releases every stream, which aborts the requests on their workers.

The first event is on the client's time-to-first-token path, so nothing stands between the stream's
queue and the socket: one stream (n = 1) is read directly, not through merge's pump task and second
queue, and SseResponse writes from the handler's task (Starlette's StreamingResponse first sets up an
anyio task group and starts the writer as a new task). The measured gain: docs/ARCHITECTURE.md, "The
gateway's own ASGI layers".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.dispatch import Dispatcher
from services.gateway.errors import CLIENT_CLOSED, GatewayError
from services.gateway.streams import RequestStream
from shared.protocol import StreamOut

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


WORKER_HEADER = "x-radixserve-worker"
GATEWAY_HEADER = "x-radixserve-gateway"  # on every HTTP response: which gateway process answered


def routing_headers(streams: list[RequestStream]) -> dict[str, str]:
    """Which worker served each choice (in choice order): for operators, and for tests that kill one."""
    return {WORKER_HEADER: ",".join(s.worker_id for s in streams)}


_json = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event: compact UTF-8 JSON (a non-finite float, which JSON cannot hold, is null)."""
    return b"data: " + _json.encode(payload) + b"\n\n"


async def single(stream: RequestStream) -> AsyncIterator[tuple[int, StreamOut]]:
    """What merge yields for one stream, without its tasks: (0, output) until the final."""
    async for out in stream.outputs():
        yield 0, out


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOut]]:
    """(choice index, output) from all streams as they arrive, until every one has its final; the
    first error raises GatewayError. The pump tasks end with the iterator, however it ends."""
    queue: asyncio.Queue[tuple[int, StreamOut | GatewayError | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream.outputs():
                queue.put_nowait((index, out))
        except GatewayError as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, GatewayError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def start_stream(
    request: Request,
    dispatcher: Dispatcher,
    streams: list[RequestStream],
    render: Callable[[AsyncIterator[tuple[int, StreamOut]]], AsyncIterator[bytes]],
) -> StreamingResponse:
    """An SSE response of `render(merged outputs)`, begun after the first output arrived. `render`
    yields SSE frames; a GatewayError it lets through becomes an error event. `[DONE]` ends it."""
    outputs = single(streams[0]) if len(streams) == 1 else merge(streams)
    try:
        first = await anext(outputs)
    except BaseException:
        for stream in streams:
            dispatcher.release(stream)
        await outputs.aclose()
        raise

    async def replay() -> AsyncIterator[tuple[int, StreamOut]]:
        yield first
        async for item in outputs:
            yield item

    async def body() -> AsyncIterator[bytes]:
        try:
            async for frame in render(replay()):
                yield frame
        except GatewayError as exc:
            request.state.stream_status = exc.status
            yield sse(exc.body())
        finally:
            for stream in streams:
                dispatcher.release(stream)
            await outputs.aclose()
        yield DONE

    headers = {**SSE_HEADERS, **routing_headers(streams)}
    return SseResponse(body(), media_type="text/event-stream", headers=headers)


class SseResponse(StreamingResponse):
    """A StreamingResponse that sends from the task it is called in, and watches for the client's
    disconnect with one plain task, started once the first frame is out. A disconnect cancels the
    sending (as Starlette's task group does); the iterator's `finally` then releases its streams."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.current_task()
        assert sender is not None
        sending, gone = True, False

        async def watch() -> None:
            nonlocal gone
            # The body has been read, so the next message is the disconnect; uvicorn also sends one once
            # the response is complete, which must not cancel anything.
            while (await receive())["type"] != "http.disconnect":
                pass
            if sending:
                gone = True
                sender.cancel()

        watcher: asyncio.Task[None] | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                data = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if watcher is None:
                    watcher = asyncio.create_task(watch())
            sending = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            # Our own cancellation, not the server's: the response ends here, as Starlette's does.
            if hasattr(sender, "uncancel"):  # Python >= 3.11
                sender.uncancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            sending = False
            if watcher is not None:
                watcher.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await `work`, calling `on_disconnect` (and raising GatewayError 499) if the client leaves
    first: a non-streaming request is aborted on its worker when nobody waits for its answer."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body has been read, so the server's next message is the disconnect (uvicorn also sends
        # one once the response is complete, by which time `work` is done): no polling.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        on_disconnect()
        raise GatewayError(CLIENT_CLOSED, "the client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
