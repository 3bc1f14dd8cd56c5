"""shared/bus.py against a real nats-server: every message type round-trips, bad payloads are dropped
without stopping a subscription, oversized messages raise before they reach NATS, streamed replies end
at the final message, and a lost server is reconnected to."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import msgspec
import pytest

from shared.bus import Bus, PayloadTooLarge
from shared.natsd import NatsServer, start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchStreamOut,
    BatchTokenOut,
    ChatMessage,
    ControlReply,
    ControlRequest,
    Finish,
    GenerateRequest,
    Logprobs,
    NatsAbort,
    NatsGenerateChunk,
    NatsGenerateRequest,
    Sampling,
    StreamOut,
    TokenizeRequest,
    TokenOut,
    TopLogprob,
    Usage,
    WorkerInfo,
    WorkerLoad,
    encode,
)
from tests.services_helpers import run

V = PROTOCOL_VERSION
SAMPLES: list[msgspec.Struct] = [
    TokenizeRequest(
        v=V, rid="r1", gateway_id="g1", worker_id="w1", sampling=Sampling(temperature=0.5, stop=["\n"], seed=3),
        messages=[ChatMessage("user", "héllo")], return_logprob=True, top_logprobs_num=2,
    ),
    GenerateRequest(v=V, rid="r1", gateway_id="g1", input_ids=[1, 2, 3], sampling=Sampling(max_new_tokens=4)),
    BatchTokenOut(
        v=V, worker_id="w1", step=7,
        items=[
            TokenOut(rid="r1", gateway_id="g1", token_ids=[5],
                     logprobs=Logprobs([-0.5], top=[[TopLogprob(5, -0.5), TopLogprob(9, -1.5)]]), first=True, stop=["x"]),
            TokenOut(rid="r2", gateway_id="g2", token_ids=[6], finish=Finish("stop", matched=6),
                     usage=Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=2)),
        ],
    ),
    BatchStreamOut(v=V, items=[StreamOut(rid="r1", text="Pa", token_ids=[5], finish=Finish("length", matched=1))]),
    ControlRequest(v=V, command="abort", rid="r1"),
    ControlReply(
        v=V, ok=True,
        info=WorkerInfo("w1", "m", 100, 8, 256, 1, 0, 90, 4, 6, 0.25, 12, 1, "cpu"),
    ),
    WorkerLoad(v=V, worker_id="w1", model="m", num_running=1, num_waiting=2, kv_usage=0.5, cache_hit_rate=0.1,
               max_total_tokens=100, context_len=256, timestamp=1.5),
    NatsGenerateRequest(v=V, text="hi", sampling=Sampling(top_k=5)),
    NatsGenerateChunk(v=V, rid="r1", text="x", final=True, finish=Finish("error", message="boom"), error="boom"),
    NatsAbort(v=V, rid="r1"),
]


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with start_nats_server() as server:
        yield server


async def _collector(bus: Bus, subject: str, types: tuple[type, ...]) -> asyncio.Queue[object]:
    received: asyncio.Queue[object] = asyncio.Queue()

    async def handler(msg: object, raw: object) -> None:
        received.put_nowait(msg)

    await bus.subscribe(subject, types, handler)
    await bus.nc.flush()
    return received


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(nats_server: NatsServer, message: msgspec.Struct) -> None:
    async def main() -> object:
        bus = await Bus.connect(nats_server.url, "test")
        received = await _collector(bus, "t.roundtrip", (type(message),))
        await bus.publish("t.roundtrip", message)
        got = await asyncio.wait_for(received.get(), 5)
        await bus.drain()
        return got

    assert run(main()) == message


def test_tagged_union_subscription_decodes_each_type(nats_server: NatsServer) -> None:
    async def main() -> list[object]:
        bus = await Bus.connect(nats_server.url, "test")
        received = await _collector(bus, "t.union", (ControlRequest, GenerateRequest))
        for message in (SAMPLES[4], SAMPLES[1]):
            await bus.publish("t.union", message)
        got = [await asyncio.wait_for(received.get(), 5) for _ in range(2)]
        await bus.drain()
        return got

    assert run(main()) == [SAMPLES[4], SAMPLES[1]]


def test_malformed_and_foreign_version_messages_are_dropped_and_the_subscription_keeps_working(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    good = ControlRequest(v=V, command="get_info")

    async def main() -> list[object]:
        bus = await Bus.connect(nats_server.url, "test")
        received = await _collector(bus, "t.bad", (ControlRequest,))
        await bus.nc.publish("t.bad", b"\xc1 not msgpack")
        await bus.nc.publish("t.bad", encode(GenerateRequest(v=V, rid="r", gateway_id="g", input_ids=[], sampling=Sampling())))
        await bus.nc.publish("t.bad", encode(ControlRequest(v=V + 1, command="get_info")))
        await bus.publish("t.bad", good)
        first = await asyncio.wait_for(received.get(), 5)
        await bus.drain()
        return [first, received.qsize()]

    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        assert run(main()) == [good, 0]
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 3


def test_a_failing_handler_does_not_stop_the_subscription(nats_server: NatsServer) -> None:
    async def main() -> list[str]:
        bus = await Bus.connect(nats_server.url, "test")
        seen: list[str] = []

        async def handler(msg: NatsAbort, raw: object) -> None:
            seen.append(msg.rid)
            if msg.rid == "boom":
                raise RuntimeError("handler bug")

        await bus.subscribe("t.fail", (NatsAbort,), handler)
        for rid in ("boom", "after"):
            await bus.publish("t.fail", NatsAbort(v=V, rid=rid))
        await bus.drain()  # delivers what was received before closing
        return seen

    assert run(main()) == ["boom", "after"]


def test_payload_too_large_is_raised_against_the_servers_max_payload(nats_server: NatsServer) -> None:
    def stream_out(text: str) -> BatchStreamOut:
        return BatchStreamOut(v=V, items=[StreamOut(rid="r", text=text, token_ids=[])])

    async def main() -> tuple[int, int, PayloadTooLarge]:
        bus = await Bus.connect(nats_server.url, "test")
        limit = bus.max_payload
        # Both texts need msgpack's 4-byte length header, so the overhead is the same.
        overhead = len(encode(stream_out("x" * 100_000))) - 100_000
        received = await _collector(bus, "t.big", (BatchStreamOut,))
        await bus.publish("t.big", stream_out("x" * (limit - overhead)))
        got = await asyncio.wait_for(received.get(), 10)
        with pytest.raises(PayloadTooLarge) as too_large:
            await bus.publish("t.big", stream_out("x" * (limit - overhead + 1)))
        await bus.drain()
        return limit, len(got.items[0].text) + overhead, too_large.value

    limit, delivered_size, error = run(main())
    assert limit == nats_server.max_payload == 8 * 1024 * 1024
    assert delivered_size == limit
    assert (error.size, error.limit) == (limit + 1, limit)
    assert "max_payload" in str(error)


def test_stream_request_yields_every_chunk_up_to_the_final_one(nats_server: NatsServer) -> None:
    async def main() -> list[NatsGenerateChunk]:
        server = await Bus.connect(nats_server.url, "server")

        async def respond(req: NatsGenerateRequest, raw: object) -> None:
            for i, text in enumerate(["a", "b", "c", "after the final"]):
                await server.respond(raw, NatsGenerateChunk(v=V, rid="r", text=text, final=i == 2))

        await server.subscribe("t.stream", (NatsGenerateRequest,), respond)
        await server.nc.flush()
        client = await Bus.connect(nats_server.url, "client")
        chunks = [
            c async for c in client.stream_request(
                "t.stream", NatsGenerateRequest(v=V, text="hi"), (NatsGenerateChunk,), lambda c: c.final, timeout=5
            )
        ]
        await client.drain()
        await server.drain()
        return chunks

    chunks = run(main())
    assert [c.text for c in chunks] == ["a", "b", "c"]
    assert [c.final for c in chunks] == [False, False, True]


def test_stream_request_times_out_when_no_reply_comes(nats_server: NatsServer) -> None:
    async def main() -> None:
        client = await Bus.connect(nats_server.url, "client")

        async def ignore(req: NatsGenerateRequest, raw: object) -> None:
            return None

        await client.subscribe("t.nobody", (NatsGenerateRequest,), ignore)
        try:
            with pytest.raises(asyncio.TimeoutError):
                async for _ in client.stream_request(
                    "t.nobody", NatsGenerateRequest(v=V, text="hi"), (NatsGenerateChunk,), lambda c: c.final, timeout=0.3
                ):
                    pass
        finally:
            await client.drain()

    run(main())


def test_request_reply_returns_the_decoded_reply(nats_server: NatsServer) -> None:
    async def main() -> ControlReply:
        server = await Bus.connect(nats_server.url, "server")

        async def answer(req: ControlRequest, raw: object) -> None:
            await server.respond(raw, ControlReply(v=V, ok=req.command == "flush_cache", message=req.command))

        await server.subscribe("t.control", (ControlRequest,), answer)
        await server.nc.flush()
        client = await Bus.connect(nats_server.url, "client")
        reply = await client.request("t.control", ControlRequest(v=V, command="flush_cache"), (ControlReply,))
        await client.drain()
        await server.drain()
        return reply

    assert run(main()) == ControlReply(v=V, ok=True, message="flush_cache")


def test_bus_logs_a_lost_server_and_resubscribes_when_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    first = start_nats_server()
    port = first.port

    async def main() -> object:
        bus = await Bus.connect(first.url, "survivor")
        received = await _collector(bus, "t.again", (NatsAbort,))
        first.stop()
        while bus.nc.is_connected:
            await asyncio.sleep(0.05)
        second = await asyncio.to_thread(start_nats_server, port=port)
        try:
            while not bus.nc.is_connected:
                await asyncio.sleep(0.05)
            await bus.publish("t.again", NatsAbort(v=V, rid="back"))
            got = await asyncio.wait_for(received.get(), 10)
            await bus.drain()
        finally:
            second.stop()
        return got

    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        assert run(main()) == NatsAbort(v=V, rid="back")
    messages = [r.getMessage() for r in caplog.records]
    assert any("survivor: lost the NATS connection" in m for m in messages)
    assert any("survivor: reconnected to NATS" in m for m in messages)


def test_many_publishes_arrive_in_order(nats_server: NatsServer) -> None:
    async def main() -> list[str]:
        bus = await Bus.connect(nats_server.url, "order")
        received = await _collector(bus, "t.order", (NatsAbort,))
        for i in range(500):
            await bus.publish("t.order", NatsAbort(v=V, rid=str(i)))
        out = [(await asyncio.wait_for(received.get(), 10)).rid for _ in range(500)]  # type: ignore[attr-defined]
        await bus.drain()
        return out

    assert run(main()) == [str(i) for i in range(500)]
