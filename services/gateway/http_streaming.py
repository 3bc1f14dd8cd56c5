"""What HTTP routes share to stream: SSE framing, merging the streams of n choices into one, starting a
response only once its first output (or error) is known, and abort when the client goes away.

A streaming route awaits the first output before it returns, so an error that comes at once (the
prompt is too long, no tokenizer) is still a 4xx/5xx status; later errors become an SSE error event
followed by `data: [DONE]`. When the client disconnects, Starlette cancels the response's iterator;
its `finally` releases every stream, which aborts the requests on their workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.gateway.dispatch import Dispatcher
from services.gateway.errors import CLIENT_CLOSED, GatewayError
from services.gateway.streams import RequestStream
from shared.protocol import StreamOut

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


WORKER_HEADER = "x-radixserve-worker"
GATEWAY_HEADER = "x-radixserve-gateway"  # on every HTTP response: which gateway process answered


def routing_headers(streams: list[RequestStream]) -> dict[str, str]:
    """Which worker served each choice (in choice order): for operators, and for tests that kill one."""
    return {WORKER_HEADER: ",".join(s.worker_id for s in streams)}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


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
    render: Callable[[AsyncIterator[tuple[int, StreamOut]]], AsyncIterator[str]],
) -> StreamingResponse:
    """An SSE response of `render(merged outputs)`, begun after the first output arrived. `render`
    yields SSE frames; a GatewayError it lets through becomes an error event. `[DONE]` ends it."""
    outputs = merge(streams)
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

    async def body() -> AsyncIterator[str]:
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
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


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
