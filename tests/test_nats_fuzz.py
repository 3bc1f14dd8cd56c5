"""Hostile messages on every NATS subject a gateway listens to leave it serving: arbitrary bytes and
well-typed but hostile msgpack messages (integers of any 64-bit value, NaN and infinite floats, odd
strings, wrong versions) on {p}.v1.generate, {p}.v1.abort, {p}.workers.load and the gateway's
{p}.gateway.{id}.stream. Each front-door request gets a final reply (an error for what is malformed,
never silence), and afterwards the gateway answers a normal request correctly. Hypothesis with a
bounded number of examples, against a scripted pipeline (tests/gateway_helpers.FakePipeline) on a
real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.natsd import NatsServer
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchStreamOut,
    ChatMessage,
    Finish,
    NatsAbort,
    NatsGenerateChunk,
    NatsGenerateRequest,
    Sampling,
    StreamOut,
    Usage,
    WorkerLoad,
)
from tests.gateway_helpers import (
    FAKE_MODEL,
    FakePipeline,
    GatewayThread,
    LoopThread,
    serving_gateway,
    wait_for_workers,
)

EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REPLY_TIMEOUT_S = 10.0

int64s = st.integers(-(2**63), 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)
# The fake pipeline hangs on prompts starting with HANG or SILENT (by design): not what is tested here.
texts = st.text(max_size=40).filter(lambda t: not t.lstrip().startswith(("HANG", "SILENT")))


def mostly(value: Any, hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`value` three times in four (so requests get past one check to the next), else `hostile`."""
    return st.one_of(st.just(value), st.just(value), st.just(value), hostile)


samplings = st.builds(
    Sampling,
    max_new_tokens=mostly(None, st.integers(0, 8) | int64s), min_new_tokens=mostly(None, int64s),
    temperature=mostly(None, floats), top_p=mostly(None, floats), top_k=mostly(None, int64s),
    seed=mostly(None, int64s), stop=mostly(None, st.lists(st.text(max_size=5), max_size=3)),
    stop_token_ids=mostly(None, st.lists(int64s, max_size=3)),
    logit_bias=mostly(None, st.dictionaries(int64s, floats, max_size=3)), regex=mostly(None, st.text(max_size=10)),
)
# One prompt field most of the time (a request with none or several is refused at the first check).
prompts = st.one_of(
    st.fixed_dictionaries({"text": texts}),
    st.fixed_dictionaries({"messages": st.lists(st.builds(ChatMessage, role=mostly("user", st.text(max_size=10)),
                                                          content=texts), min_size=1, max_size=3)}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 1000) | int64s, min_size=1, max_size=5)}),
    st.fixed_dictionaries({"text": st.none() | texts, "input_ids": st.none() | st.lists(int64s, max_size=3)}),
)
requests = st.builds(
    lambda prompt, **fields: NatsGenerateRequest(**prompt, **fields),
    prompts,
    v=mostly(PROTOCOL_VERSION, int64s),
    sampling=samplings,
    model=mostly(None, st.just(FAKE_MODEL) | st.text(max_size=10)),
    rid=mostly(None, st.text(min_size=1, max_size=20)),
    return_logprob=st.booleans(),
    top_logprobs_num=mostly(0, st.integers(0, 20) | int64s),
    stream=st.booleans(),
    chat_template_kwargs=mostly(None, st.dictionaries(st.text(max_size=8), int64s | st.text(max_size=5),
                                                      max_size=3)),
)


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    with serving_gateway(nats.url, enable_grpc=False) as gw:
        yield gw


class Client:
    """One NATS connection, on a loop thread of its own, for the test's messages."""

    def __init__(self, url: str) -> None:
        self.thread = LoopThread("fuzz-client")
        self.nc = self.thread.run(nats.connect(url))

    def publish(self, subject: str, data: bytes) -> None:
        self.thread.run(self._publish(subject, data))

    async def _publish(self, subject: str, data: bytes) -> None:
        await self.nc.publish(subject, data)
        await self.nc.flush()

    def ask(self, data: bytes) -> list[NatsGenerateChunk]:
        """Send `data` to rs.v1.generate; the replies up to the final (AssertionError on silence)."""
        return self.thread.run(self._ask(data), timeout=REPLY_TIMEOUT_S * 3)

    async def _ask(self, data: bytes) -> list[NatsGenerateChunk]:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish("rs.v1.generate", data, reply=inbox)
            chunks: list[NatsGenerateChunk] = []
            while not chunks or not chunks[-1].final:
                try:
                    raw = await sub.next_msg(timeout=REPLY_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise AssertionError(f"no final reply to {data[:200]!r}") from None
                chunks.append(msgspec.msgpack.decode(raw.data, type=NatsGenerateChunk))
            return chunks
        finally:
            await sub.unsubscribe()

    def close(self) -> None:
        self.thread.run(self.nc.close())
        self.thread.close()


@pytest.fixture(scope="module")
def client(nats: NatsServer, gateway: GatewayThread) -> Iterator[Client]:
    c = Client(nats.url)
    yield c
    c.close()


def assert_still_serving(gateway: GatewayThread, client: Client) -> None:
    """A normal request, over NATS and over HTTP, gets the right answer."""
    wait_for_workers(gateway.url, 1)
    request = NatsGenerateRequest(v=PROTOCOL_VERSION, text="still here", model=FAKE_MODEL, stream=False)
    (final,) = client.ask(msgspec.msgpack.encode(request))
    assert (final.error, final.text, final.finish) == (None, "still here ", Finish(type="stop"))
    answer = httpx.post(f"{gateway.url}/generate", json={"text": "and here"}, timeout=10).json()
    assert answer["text"] == "and here "


@FUZZ
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_on_generate_get_a_400_final(client: Client, data: bytes) -> None:
    chunks = client.ask(data)
    assert chunks[-1].error is not None and chunks[-1].error.startswith("400: ")


@settings(FUZZ, max_examples=4 * EXAMPLES)
@given(request=requests)
def test_hostile_generate_requests_each_get_a_final(client: Client, request: NatsGenerateRequest) -> None:
    final = client.ask(msgspec.msgpack.encode(request))[-1]
    if final.error is not None:
        status = int(final.error.split(":", 1)[0])
        assert status in (400, 404, 413), final.error
    else:
        assert final.finish is not None and final.finish.type in ("stop", "length")


@FUZZ
@given(value=st.recursive(st.none() | st.booleans() | int64s | floats | st.text(max_size=10) | st.binary(max_size=10),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=20))
def test_wrongly_shaped_msgpack_on_generate_gets_a_400_final(client: Client, value: Any) -> None:
    if isinstance(value, dict):
        value = {"type": "nats_generate", **value}
    final = client.ask(msgspec.msgpack.encode(value))[-1]
    assert final.error is not None and final.error.startswith(("400: ", "404: ", "413: ")), final.error


@FUZZ
@given(data=st.binary(max_size=100) | st.builds(NatsAbort, v=int64s, rid=st.text(max_size=20)).map(msgspec.msgpack.encode))
def test_hostile_aborts_are_ignored(client: Client, data: bytes) -> None:
    client.publish("rs.v1.abort", data)


loads = st.builds(
    WorkerLoad, v=st.sampled_from([PROTOCOL_VERSION]) | int64s, worker_id=st.just("w1"),
    model=st.sampled_from([FAKE_MODEL]) | st.text(max_size=10), num_running=int64s, num_waiting=int64s,
    kv_usage=floats, cache_hit_rate=floats, max_total_tokens=int64s, context_len=int64s, timestamp=floats,
)
stream_outs = st.builds(
    BatchStreamOut, v=st.sampled_from([PROTOCOL_VERSION]) | int64s,
    items=st.lists(st.builds(StreamOut, rid=st.text(max_size=10), text=st.text(max_size=10),
                             token_ids=st.lists(int64s, max_size=3),
                             usage=st.none() | st.builds(Usage, prompt_tokens=int64s, completion_tokens=int64s,
                                                         cached_tokens=int64s),
                             finish=st.none() | st.builds(Finish, type=st.text(max_size=6))),
                   max_size=3),
)


@FUZZ
@given(data=st.binary(max_size=100) | loads.map(msgspec.msgpack.encode))
def test_hostile_worker_loads_are_survived(gateway: GatewayThread, client: Client, data: bytes) -> None:
    client.publish("rs.workers.load", data)


@FUZZ
@given(data=st.binary(max_size=100) | stream_outs.map(msgspec.msgpack.encode))
def test_hostile_stream_outputs_are_survived(gateway: GatewayThread, client: Client, data: bytes) -> None:
    client.publish(f"rs.gateway.{gateway.config.gateway_id}.stream", data)


def test_the_gateway_still_serves_after_all_of_it(gateway: GatewayThread, client: Client) -> None:
    assert_still_serving(gateway, client)
