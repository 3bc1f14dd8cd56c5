"""API keys on the NATS front door ({p}.v1.generate, {p}.v1.abort): the key travels as an
`Authorization: Bearer <key>` message header and is checked by the same code as HTTP and gRPC, so a
missing or unknown key is a "401: ..." error final, a key over its limit "429: ..." with retry_after,
an unreachable Redis "503: ...", and a request's tokens count as its key's usage; a user key's abort
acts only on its own requests. Against the scripted pipeline on a real nats-server and the real Redis
at REDIS_URL (and, for the outage, a redis-server of the test's own)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator

import msgspec
import nats
import pytest
import redis

from services.gateway.auth import key_hash
from shared.natsd import NatsServer
from shared.protocol import PROTOCOL_VERSION, NatsAbort, NatsGenerateChunk, NatsGenerateRequest
from tests.gateway_helpers import (
    FakePipeline,
    GatewayThread,
    run_in_new_loop,
    serving_gateway,
    wait_for_workers,
)
from tests.keys_helpers import REDIS_URL, keys_cli, redis_namespace
from tests.services_helpers import free_port

ADMIN = "admin-secret"
CHUNK = msgspec.msgpack.Decoder(NatsGenerateChunk)
# 40 words at 50 ms a step: a stream that is still running 2 s after it starts, unless aborted.
LONG = " ".join(f"w{i}" for i in range(40))


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    yield from redis_namespace("natsauth")


def create_key(redis_url: str, prefix: str, *args: str) -> str:
    code, key = keys_cli(prefix, "create", *args, redis_url=redis_url)
    assert code == 0, key
    return key


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer, prefix: str) -> Iterator[FakePipeline]:
    with FakePipeline(nats.url, prefix=prefix, step_s=0.05) as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, prefix: str, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    with serving_gateway(
        nats.url, subject_prefix=prefix, admin_api_key=ADMIN, redis_url=REDIS_URL, enable_grpc=False
    ) as gw:
        yield gw


def headers(key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {key}"} if key is not None else None


def converse(nats_url: str, prefix: str, key: str | None, text: str = "one two three", abort: bool = False,
             abort_key: str | None = None) -> list[NatsGenerateChunk]:
    """One streamed request on {prefix}.v1.generate with `key` in its headers: every chunk up to the
    final. With `abort`, a NatsAbort carrying `abort_key` (None: no header) follows the first chunk."""

    async def ask() -> list[NatsGenerateChunk]:
        nc = await nats.connect(nats_url)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            request = NatsGenerateRequest(v=PROTOCOL_VERSION, text=text)
            await nc.publish(f"{prefix}.v1.generate", msgspec.msgpack.encode(request), reply=inbox, headers=headers(key))
            chunks: list[NatsGenerateChunk] = []
            while not chunks or not chunks[-1].final:
                chunks.append(CHUNK.decode((await sub.next_msg(timeout=30)).data))
                if abort and len(chunks) == 1 and not chunks[0].final:
                    stop = msgspec.msgpack.encode(NatsAbort(v=PROTOCOL_VERSION, rid=chunks[0].rid))
                    await nc.publish(f"{prefix}.v1.abort", stop, headers=headers(abort_key))
            return chunks
        finally:
            await nc.close()

    return run_in_new_loop(ask())


def test_a_request_without_an_authorization_header_gets_a_401_final(nats: NatsServer, prefix: str,
                                                                   gateway: GatewayThread) -> None:
    [final] = converse(nats.url, prefix, None)
    assert final.final and final.error == "401: missing API key: send `Authorization: Bearer <key>`"


def test_a_request_with_an_unknown_key_gets_a_401_final(nats: NatsServer, prefix: str, gateway: GatewayThread) -> None:
    [final] = converse(nats.url, prefix, "rs-not-a-key")
    assert final.final and final.error == "401: invalid API key"


def test_a_request_with_a_known_key_is_answered(nats: NatsServer, prefix: str, gateway: GatewayThread) -> None:
    key = create_key(REDIS_URL, prefix, "answered")
    chunks = converse(nats.url, prefix, key)
    assert "".join(c.text for c in chunks) == "one two three "
    assert chunks[-1].error is None and chunks[-1].finish is not None and chunks[-1].finish.type == "stop"
    assert converse(nats.url, prefix, ADMIN)[-1].finish is not None


def test_a_key_over_its_limit_gets_a_429_final_with_retry_after(nats: NatsServer, prefix: str,
                                                               gateway: GatewayThread) -> None:
    key = create_key(REDIS_URL, prefix, "limited", "--rpm", "2")
    if time.time() % 60 > 50:  # keep the next requests inside one rate window
        time.sleep(61 - time.time() % 60)
    assert [converse(nats.url, prefix, key, "a b")[-1].error for _ in range(2)] == [None, None]
    [final] = converse(nats.url, prefix, key)
    assert final.error == "429: rate limit of 2 requests per minute reached for key 'limited'"
    assert final.retry_after is not None and 1 <= final.retry_after <= 60


def test_a_requests_tokens_count_as_its_keys_usage(nats: NatsServer, prefix: str, gateway: GatewayThread) -> None:
    key = create_key(REDIS_URL, prefix, "metered")
    final = converse(nats.url, prefix, key, "four five six seven")[-1]
    assert (final.prompt_tokens, final.completion_tokens) == (4, 4)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    usage: dict[str, str] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not usage:
        usage = client.hgetall(f"radixserve:{prefix}:usage:{key_hash(key)}")
        time.sleep(0.05)
    assert usage == {"requests": "1", "prompt_tokens": "4", "completion_tokens": "4"}


def test_an_abort_by_another_tenant_is_ignored(nats: NatsServer, prefix: str, gateway: GatewayThread,
                                               pipeline: FakePipeline) -> None:
    owner, other = create_key(REDIS_URL, prefix, "owner-1"), create_key(REDIS_URL, prefix, "other-1")
    chunks = converse(nats.url, prefix, owner, LONG, abort=True, abort_key=other)
    assert chunks[-1].finish is not None and chunks[-1].finish.type == "stop"
    assert "".join(c.text for c in chunks) == LONG + " "
    assert not [a for a in pipeline.aborts if a[1] == chunks[0].rid]


def test_an_abort_without_a_key_is_ignored(nats: NatsServer, prefix: str, gateway: GatewayThread,
                                           pipeline: FakePipeline) -> None:
    owner = create_key(REDIS_URL, prefix, "owner-2")
    chunks = converse(nats.url, prefix, owner, LONG, abort=True, abort_key=None)
    assert chunks[-1].finish is not None and chunks[-1].finish.type == "stop"
    assert not [a for a in pipeline.aborts if a[1] == chunks[0].rid]


def test_an_abort_by_the_requests_own_key_aborts_it(nats: NatsServer, prefix: str, gateway: GatewayThread) -> None:
    owner = create_key(REDIS_URL, prefix, "owner-3")
    final = converse(nats.url, prefix, owner, "HANG " + LONG, abort=True, abort_key=owner)[-1]
    assert final.finish is not None and final.finish.type == "abort"


def test_an_abort_by_an_admin_aborts_any_request(nats: NatsServer, prefix: str, gateway: GatewayThread) -> None:
    owner = create_key(REDIS_URL, prefix, "owner-4")
    final = converse(nats.url, prefix, owner, "HANG " + LONG, abort=True, abort_key=ADMIN)[-1]
    assert final.finish is not None and final.finish.type == "abort"


def test_an_unreachable_redis_gets_a_503_final(nats: NatsServer) -> None:
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url, prefix = f"redis://127.0.0.1:{port}", f"outage{uuid.uuid4().hex[:8]}"
    pipeline: FakePipeline | None = None
    gw: GatewayThread | None = None
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        key = create_key(url, prefix, "stranded")
        pipeline = FakePipeline(nats.url, workers=("w1",), prefix=prefix)
        gw = GatewayThread(nats.url, subject_prefix=prefix, redis_url=url, admin_api_key=ADMIN, enable_grpc=False)
        wait_for_workers(gw.url, 1)
        assert converse(nats.url, prefix, key)[-1].error is None
        server.terminate()
        server.wait(timeout=10)
        [final] = converse(nats.url, prefix, key)
        assert final.error == "503: the API-key store is unreachable"
        # Static keys need no Redis.
        assert converse(nats.url, prefix, ADMIN)[-1].error is None
    finally:
        if gw is not None:
            gw.close()
        if pipeline is not None:
            pipeline.close()
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=10)
