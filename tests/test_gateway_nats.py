"""The NATS front door ({p}.v1.generate, {p}.v1.abort) with a plain nats-py client, as docs/API.md shows
it: streamed chunks to the reply inbox, an explicit final, errors as finals (a grammar that cannot
compile among them), abort, malformed
messages, and the queue group that gives each request to exactly one of several gateways.
Against a scripted pipeline (tests/gateway_helpers.FakePipeline) on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator

import msgspec
import nats
import pytest

from services.gateway.generate_spec import GenerateSpec
from services.gateway.nats_frontdoor import spec_from_nats
from shared.natsd import NatsServer
from shared.protocol import (
    PROTOCOL_VERSION,
    ChatMessage,
    NatsAbort,
    NatsGenerateChunk,
    NatsGenerateRequest,
    Sampling,
)
from tests.gateway_helpers import FakePipeline, GatewayThread, run_in_new_loop, serving_gateway

CHUNK = msgspec.msgpack.Decoder(NatsGenerateChunk)


@pytest.fixture(scope="module")
def gateways(nats: NatsServer, pipeline: FakePipeline) -> Iterator[list[GatewayThread]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serving_gateway(nats.url, enable_grpc=False)) for _ in range(2)]


async def generate(url: str, payload: bytes, abort_after_first: bool = False) -> list[NatsGenerateChunk]:
    """Send one request to rs.v1.generate and collect the replies up to the final one."""
    nc = await nats.connect(url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("rs.v1.generate", payload, reply=inbox)
        chunks: list[NatsGenerateChunk] = []
        while not chunks or not chunks[-1].final:
            chunks.append(CHUNK.decode((await sub.next_msg(timeout=10)).data))
            if abort_after_first and len(chunks) == 1:
                await nc.publish("rs.v1.abort", msgspec.msgpack.encode(NatsAbort(v=PROTOCOL_VERSION, rid=chunks[0].rid)))
        return chunks
    finally:
        await nc.close()


def request(**fields: object) -> bytes:
    return msgspec.msgpack.encode(NatsGenerateRequest(v=PROTOCOL_VERSION, **fields))  # type: ignore[arg-type]


def test_streamed_replies_end_with_an_explicit_final(nats: NatsServer, gateways: list[GatewayThread]) -> None:
    chunks = run_in_new_loop(generate(nats.url, request(text="over the wire", rid="n-1")))
    assert "".join(c.text for c in chunks) == "over the wire "
    assert [c.final for c in chunks] == [False, False, False, True]
    final = chunks[-1]
    assert final.finish is not None and final.finish.type == "stop"
    assert (final.rid, final.prompt_tokens, final.completion_tokens, final.error) == ("n-1", 3, 3, None)


def test_chat_template_kwargs_reach_the_tokenizer(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    messages = [ChatMessage("user", "think less")]
    payload = request(messages=messages, rid="n-kw", chat_template_kwargs={"enable_thinking": False})
    chunks = run_in_new_loop(generate(nats.url, payload))
    assert chunks[-1].error is None
    assert next(r for r in pipeline.requests if r.rid == "n-kw").chat_template_kwargs == {"enable_thinking": False}
    bad = run_in_new_loop(generate(nats.url, request(text="x", chat_template_kwargs={"enable_thinking": False})))
    assert bad[-1].error == "400: chat_template_kwargs apply to chat messages only"


def test_a_grammar_reaches_the_worker_and_a_bad_one_is_an_error_final(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    chunks = run_in_new_loop(generate(nats.url, request(text="x", rid="n-json", sampling=Sampling(json_schema=schema))))
    assert chunks[-1].error is None
    assert next(r for r in pipeline.requests if r.rid == "n-json").sampling.json_schema == schema
    bad = run_in_new_loop(generate(nats.url, request(text="x", sampling=Sampling(regex="(a"))))
    assert bad[-1].final and bad[-1].error.startswith("400: regex cannot be compiled")


def test_logprob_start_len_reaches_the_tokenizer_and_a_bad_one_is_an_error_final(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    """(Past the prompt's end only the worker can tell: tests/api_stack/test_echo_logprobs_api.py.)"""
    chunks = run_in_new_loop(generate(nats.url, request(text="a b", rid="n-start", return_logprob=True, logprob_start_len=1)))
    assert chunks[-1].error is None
    assert next(r for r in pipeline.requests if r.rid == "n-start").logprob_start_len == 1
    bad = run_in_new_loop(generate(nats.url, request(text="a b", return_logprob=True, logprob_start_len=-2)))
    assert bad[-1].final and bad[-1].error == "400: `logprob_start_len` must be an integer >= -1, got -2"


def test_unstreamed_request_gets_one_final_with_the_whole_text(nats: NatsServer, gateways: list[GatewayThread]) -> None:
    chunks = run_in_new_loop(
        generate(nats.url, request(text="all at once", stream=False, sampling=Sampling(max_new_tokens=2)))
    )
    assert len(chunks) == 1
    assert (chunks[0].text, chunks[0].token_ids, chunks[0].finish.type) == ("all at ", [100, 101], "length")


def test_each_request_is_served_by_exactly_one_gateway(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    async def many() -> list[list[NatsGenerateChunk]]:
        return list(await asyncio.gather(*(generate(nats.url, request(text=f"q{i}", rid=f"qg-{i}")) for i in range(8))))

    results = run_in_new_loop(many())
    assert ["".join(c.text for c in r) for r in results] == [f"q{i} " for i in range(8)]
    rids = [r.rid for r in pipeline.requests if r.rid.startswith("qg-")]
    assert sorted(rids) == sorted(f"qg-{i}" for i in range(8))  # no request was taken twice


def test_errors_arrive_as_a_final_with_error(nats: NatsServer, gateways: list[GatewayThread]) -> None:
    refused = run_in_new_loop(generate(nats.url, request(text="ERROR x")))
    assert refused[-1].final and refused[-1].error.startswith("400: ") and "too long" in refused[-1].error
    unknown = run_in_new_loop(generate(nats.url, request(text="x", model="nope")))
    assert unknown[-1].error.startswith("404: ")
    invalid = run_in_new_loop(generate(nats.url, request(text="x", sampling=Sampling(temperature=-1.0))))
    assert invalid[-1].error.startswith("400: temperature")


def test_abort_ends_the_request_with_an_abort_final(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    chunks = run_in_new_loop(generate(nats.url, request(text="HANG tight", rid="n-abort"), abort_after_first=True))
    assert chunks[-1].final and chunks[-1].finish.type == "abort"
    assert ("w1", "n-abort") in pipeline.aborts


def test_malformed_message_is_answered_and_the_door_keeps_serving(
    nats: NatsServer, gateways: list[GatewayThread]
) -> None:
    broken = run_in_new_loop(generate(nats.url, b"\x93not msgpack"))
    assert broken[-1].final and broken[-1].error.startswith("400: malformed")
    again = run_in_new_loop(generate(nats.url, request(text="still here")))
    assert "".join(c.text for c in again) == "still here "


def test_a_request_past_its_own_timeout_is_aborted_with_a_504_final(
    nats: NatsServer, gateways: list[GatewayThread], pipeline: FakePipeline
) -> None:
    chunks = run_in_new_loop(generate(nats.url, request(text="HANG on", rid="n-timeout", timeout=1.0)))
    assert chunks[0].text == "HANG "
    assert chunks[-1].final and chunks[-1].error.startswith("504: ") and "timed out" in chunks[-1].error
    pipeline.wait_until(lambda: ("w1", "n-timeout") in pipeline.aborts)
    bad = run_in_new_loop(generate(nats.url, request(text="x", timeout=-1.0)))
    assert bad[-1].error.startswith("400: timeout")


def test_a_request_states_every_field_of_its_generation() -> None:
    """Every field of a request on the front door but the protocol version reaches its GenerateSpec."""
    assert set(NatsGenerateRequest.__struct_fields__) - {f.name for f in dataclasses.fields(GenerateSpec)} == {"v"}
    fields = dict(sampling=Sampling(seed=3), messages=[ChatMessage("user", "hi")], model="m", rid="r", return_logprob=True,
                  top_logprobs_num=2, logprob_start_len=1, stream=False, chat_template_kwargs={"enable_thinking": False}, timeout=5.0)
    assert spec_from_nats(NatsGenerateRequest(v=PROTOCOL_VERSION, **fields)) == GenerateSpec(**fields)
    ids = spec_from_nats(NatsGenerateRequest(v=PROTOCOL_VERSION, input_ids=[1, 2], text=None))
    assert ids == GenerateSpec(sampling=Sampling(), input_ids=[1, 2])
