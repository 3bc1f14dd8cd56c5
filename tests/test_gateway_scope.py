"""API-key scopes at the gateway (services/gateway/auth.py, services/gateway/aborts.py): what a user key
may not do (flush caches, abort all, abort another key's request, here or on another gateway replica)
and an admin key may, on HTTP and gRPC; and `radixserve keys create --admin`. Against the scripted
pipeline on a real nats-server and the real Redis at REDIS_URL, each module under its own prefix."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest

from services.gateway.protos import radixserve_pb2, radixserve_pb2_grpc
from shared.natsd import NatsServer
from tests.gateway_helpers import FakePipeline, GatewayThread, serving_gateway
from tests.keys_helpers import REDIS_URL, keys_cli, redis_namespace

ADMIN = "admin-secret"
# 60 words at 50 ms a step: a stream that is still running 3 s after it starts, unless aborted.
LONG = " ".join(f"w{i}" for i in range(60))


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    yield from redis_namespace("scope")



@pytest.fixture(scope="module")
def tenants(prefix: str) -> dict[str, str]:
    """Two user keys (alice, bob) and an admin key (root) in Redis."""
    keys = {name: keys_cli(prefix, "create", name, *flags)[1]
            for name, flags in (("alice", ()), ("bob", ()), ("root", ("--admin",)))}
    assert all(key.startswith("rs-") for key in keys.values()), keys
    return keys


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer, prefix: str) -> Iterator[FakePipeline]:
    with FakePipeline(nats.url, prefix=prefix, step_s=0.05) as fake:
        yield fake


@pytest.fixture(scope="module")
def gateways(nats: NatsServer, prefix: str, pipeline: FakePipeline) -> Iterator[list[GatewayThread]]:
    """Two replicas of one deployment, with a static user key, a static admin key and the Redis keys."""
    options = {"subject_prefix": prefix, "api_key": "user-secret", "admin_api_key": ADMIN, "redis_url": REDIS_URL}
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serving_gateway(nats.url, **options)) for _ in range(2)]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(gw: GatewayThread, path: str, key: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body if body is not None else {}, headers=auth(key), timeout=10)


def generate(gw: GatewayThread, key: str, rid: str, text: str) -> dict:
    """A non-streaming /generate, to be run in a thread while the test aborts it (or not)."""
    reply = httpx.post(f"{gw.url}/generate", headers=auth(key), timeout=30,
                       json={"text": text, "rid": rid, "sampling_params": {"max_new_tokens": 100}})
    assert reply.status_code == 200, reply.text
    return reply.json()


@contextlib.contextmanager
def running(gw: GatewayThread, pipeline: FakePipeline, key: str,
            text: str) -> Iterator[tuple[str, concurrent.futures.Future]]:
    """A request of `key` on `gw`, yielded once the worker runs it (its rid and its future answer)."""
    rid = f"r-{uuid.uuid4().hex[:8]}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, gw, key, rid, text)
        pipeline.wait_until(lambda: rid in pipeline.in_flight("w1") or answer.done())
        yield rid, answer


def finish_of(answer: concurrent.futures.Future) -> str:
    return answer.result(timeout=30)["meta_info"]["finish_reason"]["type"]


def test_keys_create_admin_stores_the_scope_and_list_shows_it(prefix: str, tenants: dict[str, str]) -> None:
    code, listed = keys_cli(prefix, "list")
    assert code == 0
    scopes = {entry["name"]: entry["scope"] for entry in map(json.loads, listed.splitlines())}
    assert scopes == {"alice": "user", "bob": "user", "root": "admin"}


def test_a_user_key_may_not_abort_all(gateways: list[GatewayThread], tenants: dict[str, str]) -> None:
    refused = post(gateways[0], "/abort_request", tenants["alice"], {"abort_all": True})
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == 403
    assert error["message"] == "abort_all needs an admin key; key 'alice' has scope user"


def test_a_user_key_may_not_flush_the_cache(gateways: list[GatewayThread], tenants: dict[str, str],
                                           pipeline: FakePipeline) -> None:
    flushes = len([c for c in pipeline.controls if c[1] == "flush_cache"])
    for reply in (post(gateways[0], "/flush_cache", tenants["alice"]),
                  httpx.get(f"{gateways[0].url}/flush_cache", headers=auth("user-secret"), timeout=10)):
        assert reply.status_code == 403
        assert reply.json()["error"]["type"] == "permission_error"
        assert "flush_cache needs an admin key" in reply.json()["error"]["message"]
    assert len([c for c in pipeline.controls if c[1] == "flush_cache"]) == flushes


def test_an_admin_key_may_flush_the_cache(gateways: list[GatewayThread], tenants: dict[str, str],
                                          pipeline: FakePipeline) -> None:
    flushes = len([c for c in pipeline.controls if c[1] == "flush_cache"])
    redis_admin = post(gateways[0], "/flush_cache", tenants["root"])
    assert redis_admin.status_code == 200 and redis_admin.json()["success"] is True
    assert httpx.get(f"{gateways[0].url}/flush_cache", headers=auth(ADMIN), timeout=10).status_code == 200
    assert len([c for c in pipeline.controls if c[1] == "flush_cache"]) == flushes + 2


def test_an_admin_key_may_abort_all(gateways: list[GatewayThread], tenants: dict[str, str],
                                    pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["bob"], "HANG " + LONG) as (rid, answer):
        reply = post(gateways[0], "/abort_request", ADMIN, {"abort_all": True})
        assert reply.status_code == 200 and reply.json()["aborted"] == [rid]
        assert finish_of(answer) == "abort"


def test_a_tenant_may_not_abort_another_tenants_request(gateways: list[GatewayThread], tenants: dict[str, str],
                                                        pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["bob"], LONG) as (rid, answer):
        refused = post(gateways[0], "/abort_request", tenants["alice"], {"rid": rid})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "permission_error"
        assert refused.json()["error"]["param"] == "rid"
        result = answer.result(timeout=30)
    assert result["meta_info"]["finish_reason"]["type"] == "stop"
    assert result["text"] == LONG + " "
    assert not [a for a in pipeline.aborts if a[1] == rid]


def test_a_tenant_may_abort_its_own_request(gateways: list[GatewayThread], tenants: dict[str, str],
                                           pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["alice"], "HANG " + LONG) as (rid, answer):
        reply = post(gateways[0], "/abort_request", tenants["alice"], {"rid": rid})
        assert reply.json() == {"success": True, "aborted": [rid], "in_flight_here": 1}
        assert finish_of(answer) == "abort"


def test_an_admin_may_abort_a_tenants_request(gateways: list[GatewayThread], tenants: dict[str, str],
                                             pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["bob"], "HANG " + LONG) as (rid, answer):
        assert post(gateways[0], "/abort_request", tenants["root"], {"rid": rid}).json()["in_flight_here"] == 1
        assert finish_of(answer) == "abort"


def test_a_tenant_may_not_abort_another_tenants_request_on_another_replica(
        gateways: list[GatewayThread], tenants: dict[str, str], pipeline: FakePipeline) -> None:
    with running(gateways[1], pipeline, tenants["bob"], LONG) as (rid, answer):
        # The asking gateway does not hold it: it passes the abort on, and the holder ignores it.
        reply = post(gateways[0], "/abort_request", tenants["alice"], {"rid": rid})
        assert reply.json() == {"success": True, "aborted": [rid], "in_flight_here": 0}
        result = answer.result(timeout=30)
    assert result["meta_info"]["finish_reason"]["type"] == "stop" and result["text"] == LONG + " "
    assert not [a for a in pipeline.aborts if a[1] == rid]


def test_a_tenant_may_abort_its_own_request_on_another_replica(gateways: list[GatewayThread], tenants: dict[str, str],
                                                               pipeline: FakePipeline) -> None:
    with running(gateways[1], pipeline, tenants["alice"], "HANG " + LONG) as (rid, answer):
        assert post(gateways[0], "/abort_request", tenants["alice"], {"rid": rid}).json()["in_flight_here"] == 0
        assert finish_of(answer) == "abort"


def test_an_admin_may_abort_a_tenants_request_on_another_replica(gateways: list[GatewayThread],
                                                                tenants: dict[str, str], pipeline: FakePipeline) -> None:
    with running(gateways[1], pipeline, tenants["bob"], "HANG " + LONG) as (rid, answer):
        assert post(gateways[0], "/abort_request", ADMIN, {"rid": rid}).json()["in_flight_here"] == 0
        assert finish_of(answer) == "abort"


def grpc_abort(gw: GatewayThread, rid: str, key: str) -> bool:
    with grpc.insecure_channel(gw.grpc_target) as channel:
        stub = radixserve_pb2_grpc.RadixServeStub(channel)
        reply = stub.Abort(radixserve_pb2.AbortRequest(rid=rid), timeout=5, metadata=[("authorization", f"Bearer {key}")])
        return bool(reply.found)


def test_grpc_abort_of_another_tenants_request_is_permission_denied(
        gateways: list[GatewayThread], tenants: dict[str, str], pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["bob"], "HANG " + LONG) as (rid, answer):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_abort(gateways[0], rid, tenants["alice"])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "made with another API key" in refused.value.details()
        assert not [a for a in pipeline.aborts if a[1] == rid]
        post(gateways[0], "/abort_request", ADMIN, {"rid": rid})  # the hanging request ends here
        assert finish_of(answer) == "abort"


def test_grpc_abort_by_the_requests_own_key_aborts_it(gateways: list[GatewayThread], tenants: dict[str, str],
                                                     pipeline: FakePipeline) -> None:
    with running(gateways[0], pipeline, tenants["bob"], "HANG " + LONG) as (rid, answer):
        assert grpc_abort(gateways[0], rid, tenants["bob"]) is True
        assert finish_of(answer) == "abort"
